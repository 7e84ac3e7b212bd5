"""What a split forward costs the host beyond the GEMMs, and what it must keep doing (issue 28).

A stage's own module that owns no deferred parameter (a decoder block) becomes a
``RoutedStage``: no forward hooks, and the routing only where its unit's forward was routed
whole (a checkpoint re-running it in B then routes it again). A linear layer's capture is a
tensor-hook dict on its output: no Python ``RemovableHandle`` per call; B's captures are parked
when B ends, in the order B reached them, also among the routed path's own parked work.
"""

from __future__ import annotations

import copy
import inspect
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils import hooks as torch_hooks
from torch.utils.checkpoint import checkpoint

from ds_vshape.runtime.split.graph_linear import SplitLinear
from ds_vshape.runtime.split.module_hooks import RoutedStage
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward
from ds_vshape.runtime.split.split_mode import DeferMode
from ds_vshape.runtime.split.split_ops import GenericWork, MatmulWork

DIM = 8


class _Probe(nn.Module):
    """Records, on every call, whether the routing's mode is active (no parameters of its own)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(any(isinstance(m, DeferMode) for m in torch.overrides._get_current_function_mode_stack()))
        return x


class Block(nn.Module):
    """A decoder-block stand-in: two linears, a norm, a probe of the routing."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.norm = nn.Linear(DIM, 3 * DIM), nn.Linear(3 * DIM, DIM), nn.LayerNorm(DIM)
        self.probe = _Probe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.probe(self.norm(x)))))


class Embedded(nn.Module):
    """An embedding (the routed path parks its work in B) before two linears (captured on the graph)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc1, self.fc2 = nn.Embedding(11, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.relu(self.fc1(self.emb(ids))))


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(seed))


def _unit(module: nn.Module, store: WeightGradStore, key: int, x: torch.Tensor, *, wrap: Any = None) -> torch.Tensor:
    """One split micro-batch, F and B; returns the output (W left to the caller)."""
    with store.forward_of(key, scope="stage"):
        out = wrap(module, x) if wrap is not None else module(x)
    with store.deferring(key):
        out.square().sum().backward()
    return out


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _warmed() -> tuple[Block, Block, WeightGradStore]:
    """A reference block, and a split one whose scope's first (whole-routed) unit is done and cleared."""
    reference, block = Block(), Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _unit(block, store, 0, _x())
    store.run(0)
    block.zero_grad(set_to_none=True)
    return reference, block, store


def test_a_stage_module_becomes_a_routed_stage_of_its_own_class_without_hooks() -> None:
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    assert isinstance(block, RoutedStage) and isinstance(block, Block)
    assert type(block).__name__ == "Block" and type(block).__qualname__ == Block.__qualname__
    assert not block._forward_hooks and not block._forward_pre_hooks  # nn.Module's fast call path
    assert inspect.signature(block.forward) == inspect.signature(Block().forward)  # what introspection reads
    twin = copy.deepcopy(block)
    assert type(twin) is type(block) and twin._ds_vshape_bound.store is store  # shared, not copied with its work
    other = WeightGradStore()
    enable_split_backward([twin], other)
    assert twin._ds_vshape_bound.store is other and block._ds_vshape_bound.store is store


def test_the_block_is_routed_only_while_its_scope_is_routed_whole() -> None:
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    for key in range(3):
        _unit(block, store, key, _x(key))
        store.run(key)
    # The first forward routes everything; later ones only the modules owning deferred parameters (none here:
    # the linears split on the graph), and nothing routes outside a unit's forward.
    assert block.probe.seen == [True, False, False]
    block(_x())
    assert block.probe.seen[-1] is False


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_checkpoint_re_running_the_block_in_b_routes_it_as_its_forward_was(reentrant: bool) -> None:
    """The first forward is routed whole: the re-run in B (through the block's own call) is routed too,
    so it saves what the forward saved; later forwards and their re-runs are not routed. Gradients
    equal a fused backward's."""
    reference, block = Block(), Block()
    store = WeightGradStore()
    enable_split_backward([block], store)

    def wrap(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(module, x, use_reentrant=reentrant)

    for key in range(2):
        leaf = _x(key).requires_grad_()
        reference(leaf).square().sum().backward()
        block.probe.seen.clear()
        _unit(block, store, key, _x(key).requires_grad_(), wrap=wrap)
        assert block.probe.seen == ([True, True] if key == 0 else [False, False])  # forward, then its re-run in B
    for key in range(2):
        store.run(key)
    want = _grads(reference)
    got = _grads(block)
    assert set(got) == set(want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_split_forward_builds_no_python_hook_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once the scope's first forward is done, a forward registers its captures without one Python
    ``RemovableHandle`` (each linear layer's pre-hook built one before)."""
    _, block, store = _warmed()
    made: list[object] = []
    init = torch_hooks.RemovableHandle.__init__

    def counting(self: Any, *args: Any, **kwargs: Any) -> None:
        made.append(self)
        init(self, *args, **kwargs)

    monkeypatch.setattr(torch_hooks.RemovableHandle, "__init__", counting)
    with store.forward_of(1, scope="stage"):
        out = block(_x().requires_grad_())
    assert made == []
    with store.deferring(1):
        out.sum().backward()
    assert len(store.parked_of(1)) == 2  # both linears' weight work, captured in B


def test_a_users_hook_on_the_output_can_be_removed() -> None:
    """The capture's hook dict takes the user's own hooks (and their handles' weak references): a hook
    removed before B changes nothing, one kept scales the weight gradient as in a fused backward."""
    reference, block, store = _warmed()

    def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        h = module.fc1(x)
        assert h._base is None  # 2-D: the GEMM's own output, where the capture's dict is
        h.register_hook(lambda g: g * 100.0).remove()
        h.register_hook(lambda g: g * 3.0)
        if isinstance(module.fc1, SplitLinear):
            assert list(h._backward_hooks)[-1] == -1  # the capture (its key) stays last
        return h.square().sum()

    x = _x(2).reshape(-1, DIM)
    run(reference, x.clone().requires_grad_()).backward()
    with store.forward_of(1, scope="stage"):
        out = run(block, x.clone().requires_grad_())
    with store.deferring(1):
        out.backward()
    store.run(1)
    torch.testing.assert_close(block.fc1.weight.grad, reference.fc1.weight.grad, rtol=1e-6, atol=1e-6)


def test_b_parks_in_the_order_it_reached_the_work_routed_and_captured_alike() -> None:
    """The linears' captures are parked when B ends, the embedding's routed work while B runs: W still
    gets them in the order B reached them (fc2, fc1, then the embedding), and the gradients are exact."""
    reference, model = Embedded(), Embedded()
    store = WeightGradStore()
    enable_split_backward([model], store)
    ids = torch.randint(0, 11, (2, 5), generator=torch.Generator().manual_seed(3))
    for key in range(2):
        reference(ids).square().sum().backward()
        _unit(model, store, key, ids)
    order: list[torch.Tensor] = []
    for work in store.parked_of(1):
        if isinstance(work, MatmulWork):
            order.append(work.weight)
        else:
            assert isinstance(work, GenericWork)
            order.extend(work.targets)
    assert [id(t) for t in order] == [id(model.fc2.weight), id(model.fc1.weight), id(model.emb.weight)]
    for key in range(2):
        store.run(key)
    want = _grads(reference)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_backward_outside_any_unit_takes_the_gradient_only_where_the_node_runs() -> None:
    """Outside a unit's B a capture waits for its node, for that backward only: ``torch.autograd.grad``
    asking for the output itself takes nothing, a fused backward after it runs the weight's work once."""
    reference, block, store = _warmed()
    x = _x(4).reshape(-1, DIM)  # 2-D: the linear's output is the GEMM's own (3-D with a bias: a view of it)
    with store.forward_of(1, scope="stage"):
        h = block.fc1(x.clone().requires_grad_())
    assert h._base is None
    loss = h.square().sum()
    torch.autograd.grad(loss, [h], retain_graph=True)
    assert block.fc1.weight.grad is None
    loss.backward()  # no unit's B: fused, the weight gradient now
    reference.fc1(x.clone().requires_grad_()).square().sum().backward()
    torch.testing.assert_close(block.fc1.weight.grad, reference.fc1.weight.grad, rtol=1e-6, atol=1e-6)
    assert store.pending() == []


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_hugging_face_block_checkpointing_itself_splits_exactly(reentrant: bool) -> None:
    """A ``transformers`` decoder layer as a stage's own module, with its own gradient checkpointing
    (``GradientCheckpointingLayer`` checkpoints its outermost ``forward``: here the ``RoutedStage``'s,
    so its re-run in B is routed like its forward). Two micro-batches, the first routed whole:
    input and parameter gradients equal a fused backward's with the same checkpointing."""
    from functools import partial

    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=16, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2,
                         num_hidden_layers=1, vocab_size=11, max_position_embeddings=16)
    torch.manual_seed(0)
    reference = LlamaDecoderLayer(config, layer_idx=0)
    layer = copy.deepcopy(reference)
    for mod in (reference, layer):
        mod.train()
        mod.gradient_checkpointing = True
        mod._gradient_checkpointing_func = partial(checkpoint, use_reentrant=reentrant)
    store = WeightGradStore()
    enable_split_backward([layer], store)
    assert isinstance(layer, RoutedStage) and isinstance(layer, LlamaDecoderLayer)
    xs = [torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(k)) for k in range(2)]
    rope = LlamaRotaryEmbedding(config)
    position = rope(xs[0], torch.arange(5).unsqueeze(0))

    def run(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return module(x, position_embeddings=position)

    want_inputs = []
    for x in xs:
        leaf = x.clone().requires_grad_()
        run(reference, leaf).square().sum().backward()
        want_inputs.append(leaf.grad)
    seen: list[bool] = []
    layer.mlp.register_forward_pre_hook(
        lambda *_: seen.append(any(isinstance(m, DeferMode) for m in torch.overrides._get_current_function_mode_stack())))
    got_inputs = []
    for key, x in enumerate(xs):
        leaf = x.clone().requires_grad_()
        _unit(layer, store, key, leaf, wrap=run)
        got_inputs.append(leaf.grad)
    assert seen == [True, True, False, False]  # forward and its re-run in B routed for the first unit only
    assert all(p.grad is None for n, p in layer.named_parameters() if n.endswith("proj.weight"))  # W's, not B's
    for key in range(2):
        store.run(key)
    for got, want in zip(got_inputs, want_inputs):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    want = _grads(reference)
    got = _grads(layer)
    assert set(got) == set(want)
    for name, grad in got.items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_grad_call_the_routing_sees_in_b_takes_nothing() -> None:
    """``torch.autograd.grad`` asking for a linear layer's own output inside the unit's B (the routing
    sees it) leaves the capture alone: the unit's backward after it parks the weight's work once."""
    reference, block, store = _warmed()
    x = _x(5).reshape(-1, DIM)
    with store.forward_of(1, scope="stage"):
        h = block.fc1(x.clone().requires_grad_())
    loss = h.square().sum()
    with store.deferring(1):
        torch.autograd.grad(loss, [h], retain_graph=True)
        loss.backward()
    assert len(store.parked_of(1)) == 1
    store.run(1)
    reference.fc1(x.clone().requires_grad_()).square().sum().backward()
    torch.testing.assert_close(block.fc1.weight.grad, reference.fc1.weight.grad, rtol=1e-6, atol=1e-6)


def test_an_output_detached_in_place_still_gets_its_weight_gradient() -> None:
    """``detach_()`` on a linear layer's output after another op consumed it: the GEMM's node still runs
    in a backward outside any unit (fused), and the weight gradient arrives."""
    reference, block, store = _warmed()
    x = _x(6).reshape(-1, DIM)
    with store.forward_of(1, scope="stage"):
        h = block.fc1(x.clone().requires_grad_())
        y = h * 2.0
        h.detach_()
    y.sum().backward()
    (reference.fc1(x.clone().requires_grad_()) * 2.0).sum().backward()
    torch.testing.assert_close(block.fc1.weight.grad, reference.fc1.weight.grad, rtol=1e-6, atol=1e-6)


def test_b_holds_no_graph_of_a_reentrant_checkpoint_until_it_ends() -> None:
    """A reentrant checkpoint's re-run hands B a recomputed input with its segment's graph: the capture
    keeps it detached, so that graph (its input and gradient) is freed segment by segment."""
    _, block, store = _warmed()
    kept: list[bool] = []
    with store.forward_of(1, scope="stage"):
        out = checkpoint(block, _x().requires_grad_(), use_reentrant=True)
    with store.deferring(1):
        out.square().sum().backward()
        kept = [x.requires_grad or x.grad_fn is not None for _, x, _ in store._captured]
    assert kept == [False, False]  # both linears captured in this B, neither with a graph


def test_a_module_with_a_forward_of_its_own_instance_keeps_hooks() -> None:
    """A ``forward`` set on the instance (accelerate's hooks, a patch) would pass the class's by: such a
    module keeps the routing's forward hooks instead of a ``RoutedStage`` class."""
    block = Block()
    block.forward = block.forward  # type: ignore[method-assign]  # a bound method in the instance dict
    store = WeightGradStore()
    enable_split_backward([block], store)
    assert not isinstance(block, RoutedStage) and block._forward_pre_hooks and block._forward_hooks
    _unit(block, store, 0, _x())
    store.run(0)
    assert block.probe.seen == [True]
