"""``nn.Linear`` split on autograd's graph (``graph_linear``): no Python node in F, the same gradients.

After a scope's first (routed) forward, a plain ``nn.Linear`` runs its GEMM on the weight
detached: autograd's native node computes the input's gradient in B, a hook on the output parks
the weight's work, W computes it. Checked against a fused backward on a small block (``host_stage``'s test runs Hugging Face
Llama blocks, the engine tiers train them): exact gradients, no custom autograd node in the
graph, W's input kept through the saved-tensor hooks (meter, offload, checkpoint), a second
backward, ``torch.autograd.grad``, in-place changes on either side of the GEMM, and the calls
that take the routed path instead.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.utils.checkpoint import checkpoint

from ds_vshape.runtime.split.graph_linear import SplitLinear
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward
from ds_vshape.runtime.split.split_ops import MatmulWork

DIM = 8


class Block(nn.Module):
    """Two linears around a norm and a nonlinearity, with a residual; ``checkpointed``: non-reentrant."""

    def __init__(self, *, bias: bool = True, checkpointed: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc1, self.fc2, self.norm = nn.Linear(DIM, 3 * DIM, bias=bias), nn.Linear(3 * DIM, DIM, bias=bias), nn.LayerNorm(DIM)
        self.checkpointed = checkpointed

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, x, use_reentrant=False) if self.checkpointed else self.inner(x)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def _fused(module: nn.Module, xs: list[torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[torch.Tensor]]:
    input_grads = []
    for x in xs:
        leaf = x.clone().requires_grad_()
        module(leaf).square().sum().backward()
        input_grads.append(leaf.grad)
    return _grads(module), input_grads


def _split(module: nn.Module, store: WeightGradStore, xs: list[torch.Tensor], *, hooks: Any = None) -> list[torch.Tensor]:
    """F and B of every micro-batch first, then the Ws (as a zero-bubble schedule orders them)."""
    input_grads = []
    for key, x in enumerate(xs):
        leaf = x.clone().requires_grad_()
        with store.forward_of(key, scope="stage"), (hooks if hooks is not None else _null()):
            out = module(leaf)
        with store.deferring(key):
            out.square().sum().backward()
        input_grads.append(leaf.grad)
    for key in range(len(xs)):
        store.run(key)
    return input_grads


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _custom_nodes(out: torch.Tensor) -> list[str]:
    seen, todo, found = set(), [out.grad_fn], []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, BackwardCFunction):
            found.append(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return found


def _inputs(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2, 5, DIM, generator=gen) for _ in range(n)]


@pytest.mark.parametrize("cheap_in_b", [True, False])
def test_gradients_equal_a_fused_backward_and_w_does_the_weights(cheap_in_b: bool) -> None:
    reference, split = Block(), Block()
    store = WeightGradStore(cheap_in_b=cheap_in_b)
    enable_split_backward([split], store)
    assert type(split.fc1) is SplitLinear and isinstance(split.fc1, nn.Linear)
    xs = _inputs(3)
    want, want_in = _fused(reference, xs)
    got_in = _split(split, store, xs)
    got = _grads(split)
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)
    for a, b in zip(got_in, want_in):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert store.pending() == [] and store.parked_bytes == 0


def test_after_the_first_forward_the_graph_has_no_python_node_and_b_parks_gemm_work() -> None:
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _split(block, store, _inputs(1))  # the scope's first forward: routed whole
    block.zero_grad(set_to_none=True)
    leaf = _inputs(1)[0].requires_grad_()
    with store.forward_of(7, scope="stage"):
        out = block(leaf)
    assert _custom_nodes(out) == []  # native GEMM nodes only: no autograd.Function per linear
    with store.deferring(7):
        out.square().sum().backward()
    works = store.parked_of(7)
    assert [type(w) for w in works] == [MatmulWork, MatmulWork]  # fc2, then fc1: B's order
    assert all(p.grad is None for n, p in block.named_parameters() if p.dim() == 2)  # weights wait for W
    assert block.norm.weight.grad is not None and block.fc1.bias.grad is not None  # cheap ones are B's
    store.run(7)
    assert block.fc1.weight.grad is not None and block.fc2.weight.grad is not None


def test_the_kept_input_goes_through_the_saved_tensor_hooks() -> None:
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _split(block, store, _inputs(1))
    block.zero_grad(set_to_none=True)
    packed: list[int] = []
    unpacked: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.untyped_storage().data_ptr())
        return t

    def unpack(t: torch.Tensor) -> torch.Tensor:
        unpacked.append(t.untyped_storage().data_ptr())
        return t

    leaf = _inputs(1)[0].requires_grad_()
    with store.forward_of(1, scope="stage"), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        hidden = block.fc1(leaf)
    assert leaf.untyped_storage().data_ptr() in packed  # W's input, handed to the hooks like a saved tensor
    with store.deferring(1):
        hidden.sum().backward()
    assert leaf.untyped_storage().data_ptr() in unpacked
    store.run(1)
    torch.testing.assert_close(block.fc1.weight.grad, torch.ones(3 * DIM, 2 * 5).matmul(leaf.detach().reshape(-1, DIM)))


def test_a_non_reentrant_checkpoint_recomputes_and_stays_exact() -> None:
    reference, split = Block(checkpointed=True), Block(checkpointed=True)
    store = WeightGradStore()
    enable_split_backward([split], store)
    xs = _inputs(3)
    want, _ = _fused(reference, xs)
    _split(split, store, xs)
    got = _grads(split)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_a_fused_backward_of_a_split_unit_computes_the_weights_at_once() -> None:
    reference, split = Block(), Block()
    store = WeightGradStore()
    enable_split_backward([split], store)
    xs = _inputs(2)
    want, _ = _fused(reference, xs)
    for key, x in enumerate(xs):
        with store.forward_of(key, scope="stage"):
            out = split(x.clone().requires_grad_())
        with store.backward_of(key, defer=False):
            out.square().sum().backward()
    assert store.pending() == []
    for name, grad in _grads(split).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_bf16_autocast_matches_the_routed_path() -> None:
    routed, graph = Block(), Block()
    stores = WeightGradStore(), WeightGradStore()
    enable_split_backward([routed], stores[0])
    enable_split_backward([graph], stores[1])
    xs = _inputs(2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _split(graph, stores[1], xs)  # the first forward routed, the second on the graph
        stores[0]._modules_suffice.clear()
        for key, x in enumerate(xs):  # every forward routed whole: the routed path throughout
            stores[0]._modules_suffice.discard("stage")
            _split_one(routed, stores[0], key, x)
    for (name, a), b in zip(_grads(graph).items(), _grads(routed).values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def _split_one(module: nn.Module, store: WeightGradStore, key: int, x: torch.Tensor) -> None:
    with store.forward_of(key, scope="stage"):
        out = module(x.clone().requires_grad_())
    store._modules_suffice.discard("stage")
    with store.deferring(key):
        out.float().square().sum().backward()
    store.run(key)


def test_what_does_not_fit_the_graph_split_takes_the_routed_path() -> None:
    class Own(nn.Linear):
        """A subclass may have a forward of its own: never taken over."""

    block = Block()
    block.fc1 = Own(DIM, 3 * DIM)
    store = WeightGradStore()
    enable_split_backward([block], store)
    assert type(block.fc1) is Own and type(block.fc2) is SplitLinear
    _split(block, store, _inputs(1))
    block.zero_grad(set_to_none=True)
    constant = _inputs(1)[0]  # no gradient wanted for the input: the weight's GEMM is routed
    with store.forward_of(3, scope="stage"):
        out = block.fc2(torch.cat([constant, constant, constant], dim=-1))
    assert [n.rsplit("Backward", 1)[0] for n in _custom_nodes(out)] == ["_SplitMatmul"]
    with store.deferring(3):
        out.sum().backward()
    assert block.fc2.weight.grad is None
    store.run(3)
    assert block.fc2.weight.grad is not None


def test_a_deep_copy_stays_split_on_its_own_store() -> None:
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    twin = copy.deepcopy(block)
    assert type(twin.fc1) is SplitLinear and twin.fc1._ds_vshape_store is store  # shared, not copied with its work
    other = WeightGradStore()
    enable_split_backward([twin], other)
    assert twin.fc1._ds_vshape_store is other and block.fc1._ds_vshape_store is store
    want, _ = _fused(Block(), _inputs(2))
    _split(twin, other, _inputs(2))
    for name, grad in _grads(twin).items():
        torch.testing.assert_close(grad, want[name], rtol=1e-6, atol=1e-6, msg=name)


def test_the_host_stage_benchmark_runs_every_way(tmp_path: Any) -> None:
    """``make bench-host``'s stage table (issue 28 a), a few reps: every way and pass is there."""
    from benchmarks import host_stage

    out = tmp_path / "host_stage.md"
    assert host_stage.main(["--blocks", "1", "--seq-len", "8", "--reps", "2", "--warmup", "1", "--out", str(out)]) == 0
    text = out.read_text()
    for way in host_stage.WAYS:
        assert f"| {way} |" in text
    assert "x fused" in text and "F x plain" in text


def test_the_host_profile_benchmark_profiles_each_pass_alone(tmp_path: Any) -> None:
    """``benchmarks/host_profile.py``, a few reps: a section per profiled pass, each with only its own pass's calls."""
    from benchmarks import host_profile

    out = tmp_path / "host_profile.md"
    assert host_profile.main(["--blocks", "1", "--seq-len", "8", "--reps", "2", "--warmup", "1", "--top", "40",
                              "--out", str(out)]) == 0
    sections = dict(part.split("\n", 1) for part in out.read_text().split("\n## ")[1:])
    assert list(sections) == [f"{way}: {p}" for way, passes in host_profile.PROFILED.items() for p in passes]
    # The GEMM capture runs in ds_vshape's B (one call per linear layer) and in no forward.
    def rows(section: str) -> list[str]:
        return [line for line in sections[section].splitlines() if "graph_linear.py" in line and "__call__" in line]

    assert rows("ds_vshape: B") and not rows("ds_vshape: F") and not rows("fused: B")
    assert "run_backward" not in sections["ds_vshape: F"] and "run_backward" in sections["fused: B"]


def test_the_gradient_edge_prototype_equals_a_fused_backward(tmp_path: Any) -> None:
    """``benchmarks/split_capture_edges.py``: B through ``torch.autograd.grad`` on the GEMMs' gradient edges,
    W from what it returned: every gradient a fused backward's, and a row per way."""
    from benchmarks import split_capture_edges as edges
    from benchmarks import host_stage

    torch.manual_seed(host_stage.SEED)
    stage = host_stage.build(blocks=1, seq_len=8, micro_batch=2)
    modules, in_b = edges._edge_modules(stage)
    assert in_b and all(p.dim() == 1 for p in in_b)  # only the norms' weights: every matrix goes through W
    assert edges.check(stage, modules, in_b) <= 1e-6
    out = tmp_path / "edges.md"
    assert edges.main(["--blocks", "1", "--seq-len", "8", "--reps", "2", "--warmup", "1", "--out", str(out)]) == 0
    assert [line.split(" | ")[0] for line in out.read_text().splitlines() if line.startswith("| ") and "x |" in line] == [
        f"| {way}" for way in edges.WAYS]


def test_the_split_parts_benchmark_prints_a_row_per_variant_it_is_given(capsys: Any) -> None:
    """``benchmarks/split_parts.py``'s parent: a process per variant asked for (one here: each takes
    seconds of imports; the next test runs every variant's measurement), a row each."""
    from benchmarks import split_parts

    asked = ["F, GEMM only"]
    assert split_parts.main(["--blocks", "1", "--seq-len", "8", "--reps", "2", "--warmup", "1", "--variants", *asked]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and line.endswith("x |")]
    assert [row.split(" | ")[0].removeprefix("| ") for row in rows] == asked


# benchmarks/split_parts.py's VARIANTS (not imported at collection: it loads transformers).
SPLIT_PARTS_VARIANTS = ("control", "F", "F, no capture", "F, no hooks", "F, GEMM only", "B", "B, empty capture")


@pytest.mark.parametrize("variant", SPLIT_PARTS_VARIANTS)
def test_every_split_parts_variant_times_both_sides(variant: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variant's measurement, here in the test's process (the benchmark gives each a process of its
    own): the classes it patches to take a part out are restored after the test."""
    from benchmarks import split_parts
    from ds_vshape.runtime.split import graph_linear

    assert split_parts.VARIANTS == SPLIT_PARTS_VARIANTS
    monkeypatch.setattr(graph_linear.SplitLinear, "forward", graph_linear.SplitLinear.forward)
    monkeypatch.setattr(graph_linear.GemmCapture, "__call__", graph_linear.GemmCapture.__call__)
    args = split_parts.stage_parser("", reps=2).parse_args(["--blocks", "1", "--seq-len", "8", "--reps", "2", "--warmup", "1"])
    mine, base = split_parts._one(variant, args)
    assert mine > 0 and base > 0


def _warm(block: nn.Module, store: WeightGradStore) -> None:
    """The scope's first forward (routed whole) done, gradients cleared: later forwards split on the graph."""
    _split(block, store, _inputs(1))
    block.zero_grad(set_to_none=True)


def test_a_second_backward_through_a_retained_graph_is_refused_by_name() -> None:
    """The first backward hands the kept input to W (and the meter counts it off, as autograd frees
    saved tensors): a second one through the same graph cannot add the weight gradient again."""
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _warm(block, store)
    with store.forward_of(5, scope="stage"):
        out = block(_inputs(1)[0].requires_grad_()).square().sum()
    with store.deferring(5):
        out.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match=r"second backward through 0.fc2 .*\(retain_graph\) is not supported"):
            out.backward()


def test_autograd_grad_returns_input_gradients_and_leaves_weights_alone() -> None:
    reference, block = Block(), Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _warm(block, store)
    x = _inputs(1)[0]
    leaf = x.clone().requires_grad_()
    (want,) = torch.autograd.grad(reference(leaf).square().sum(), leaf)
    leaf = x.clone().requires_grad_()
    with store.forward_of(6, scope="stage"):
        out = block(leaf).square().sum()
    with store.backward_of(6, defer=False):
        (got,) = torch.autograd.grad(out, leaf)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert all(p.grad is None for p in block.parameters()) and store.pending() == []


def test_an_input_changed_in_place_after_the_forward_is_named_not_used() -> None:
    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _warm(block, store)
    hidden = _inputs(1)[0].requires_grad_() * 1.0
    with store.forward_of(8, scope="stage"):
        out = block.fc1(hidden)
    with torch.no_grad():
        hidden.add_(100.0)
    # Raised as B ends (where B's captures are parked), and nothing of that B is parked.
    with pytest.raises(RuntimeError, match=r"input of 0.fc1 .* modified in place .* clone"), store.deferring(8):
        out.sum().backward()
    assert store.pending() == [] and store.parked_bytes == 0


def test_an_in_place_op_on_the_output_keeps_the_weight_gradient() -> None:
    """A 3-D input's output is a view of the GEMM's: an in-place op on it rebases the view, and the
    capture must sit on the GEMM's own output (its node) to see the gradient."""

    def run(block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return torch.relu_(block.fc1(x)).square().sum()

    reference, block = Block(), Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _warm(block, store)
    x = _inputs(1)[0]
    run(reference, x.clone().requires_grad_()).backward()
    with store.forward_of(9, scope="stage"):
        out = run(block, x.clone().requires_grad_())
    with store.deferring(9):
        out.backward()
    store.run(9)
    torch.testing.assert_close(block.fc1.weight.grad, reference.fc1.weight.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dims", [2, 3])
@pytest.mark.parametrize("in_place", [False, True])
def test_a_users_hook_that_changes_the_output_gradient_changes_the_weight_gradient_too(dims: int, in_place: bool,
                                                                                        bias: bool) -> None:
    """A hook the user puts on a linear layer's output (the GEMM's own tensor for a 2-D input; for
    a 3-D one a view of it, or its unsafe view without a bias) runs before the split takes the
    output gradient: W sees the gradient the hook returned, as the fused backward's weight
    gradient does, also when the output is then changed in place; and ``torch.autograd.grad``
    taking that output as its input first leaves the split's capture alone."""
    seen: dict[str, int] = {"reference": 0, "split": 0}

    def run(block: nn.Module, x: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        h = block.fc1(x)

        def scale(g: torch.Tensor) -> torch.Tensor:
            seen[name] += 1
            return g * 10.0

        h.register_hook(scale)
        out = (torch.relu_(h) if in_place else torch.relu(h)).square().sum()
        return out, h

    reference, block = Block(bias=bias), Block(bias=bias)
    store = WeightGradStore()
    enable_split_backward([block], store)
    _warm(block, store)
    x = _inputs(1)[0]
    x = x.reshape(-1, DIM) if dims == 2 else x
    run(reference, x.clone().requires_grad_(), "reference")[0].backward()
    with store.forward_of(9, scope="stage"):
        out, h = run(block, x.clone().requires_grad_(), "split")
    if not in_place:  # an in-place op takes h out of the graph's inputs
        torch.autograd.grad(out, [h], retain_graph=True)
        seen["split"] = 0
    assert not store.parked_of(9)
    with store.deferring(9):
        out.backward()
    assert store.parked_of(9), "B parked no work: the output was not split on the graph"
    store.run(9)
    assert seen["split"] == seen["reference"]
    torch.testing.assert_close(block.fc1.weight.grad, reference.fc1.weight.grad, rtol=1e-6, atol=1e-6)


class _Scale(torch.autograd.Function):
    """A custom Function fed by a parameter only: its output is parameter-like to the routing."""

    @staticmethod
    def forward(ctx, w):  # type: ignore[no-untyped-def, override]
        return w * 2.0

    @staticmethod
    def backward(ctx, g):  # type: ignore[no-untyped-def, override]
        return g * 2.0


def test_the_plan_of_each_kind_of_call() -> None:
    from ds_vshape.runtime.split.graph_linear import GRAPH, PLAIN, ROUTED

    block = Block()
    store = WeightGradStore()
    enable_split_backward([block], store)
    _warm(block, store)
    fc, x = block.fc1, _inputs(1)[0].requires_grad_()
    assert store.linear_plan(x, fc.weight, fc.bias) == PLAIN  # no unit's forward runs
    with store.forward_of(10, scope="stage"):
        assert store.linear_plan(x, fc.weight, fc.bias) == GRAPH
        with torch.no_grad():
            assert store.linear_plan(x, fc.weight, fc.bias) == PLAIN
        assert store.linear_plan(x.detach(), fc.weight, fc.bias) == ROUTED  # no gradient for the input
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert store.linear_plan(x, fc.weight, fc.bias) == ROUTED
        derived = _Scale.apply(block.fc1.weight)  # (3 DIM, DIM): a weight computed from a parameter
        assert store.linear_plan(derived, fc.weight, fc.bias) == ROUTED
        fc.weight.ds_id = 0  # what ZeRO-3 marks a partitioned parameter with
        try:
            assert store.linear_plan(x, fc.weight, fc.bias) == ROUTED
        finally:
            del fc.weight.ds_id
