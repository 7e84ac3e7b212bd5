"""ds_vshape.hf.seq_chunk: a two-stage pipeline run in sequence chunks equals the unchunked model."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import copy
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.autograd.graph import GradientEdge
from torch.nn.attention.bias import CausalBias
from torch.overrides import TorchFunctionMode
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    GPT2Config,
    GPTNeoXConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    PreTrainedModel,
    Qwen2Config,
    Qwen3Config,
)

from ds_vshape import hf
from ds_vshape.hf import chunkable as hf_chunkable

VOCAB = 128
SEQ = 16
TOL = 1e-5
Step = Callable[[Any], Any]


def _decoder(**extra: Any) -> dict[str, Any]:
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query attention
        vocab_size=VOCAB,
        max_position_embeddings=64,
        **extra,
    )


def _config(arch: str, **overrides: Any) -> PretrainedConfig:
    if arch == "gpt2":  # learned absolute positions, tied head
        kwargs = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB)
        kwargs.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2Config(**{**kwargs, **overrides})
    if arch == "llama":
        return LlamaConfig(**{**_decoder(num_hidden_layers=3), **overrides})
    if arch == "mistral":  # sliding window 4 < SEQ: it crosses chunk boundaries
        return MistralConfig(**{**_decoder(num_hidden_layers=2, sliding_window=4), **overrides})
    if arch == "qwen2":  # full attention in layers 0-1, sliding in 2-3, tied head
        extra = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2)
        return Qwen2Config(**{**_decoder(**extra, tie_word_embeddings=True), **overrides})
    if arch == "qwen3":  # per-head q/k norms, explicit head_dim
        return Qwen3Config(**{**_decoder(num_hidden_layers=2, head_dim=8), **overrides})
    if arch == "gpt_neox":  # partial rotary, parallel residual; blocks take the cache as layer_past
        kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0)
        return GPTNeoXConfig(**{**kwargs, **overrides})
    if arch == "granite":  # the LM divides its logits by logits_scaling
        extra = dict(num_hidden_layers=2, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5)
        return GraniteConfig(**{**_decoder(**extra), **overrides})
    if arch == "gemma2":  # soft-capped attention and logits, alternating sliding/full layers, tied head
        extra = dict(num_hidden_layers=2, head_dim=8, sliding_window=4, final_logit_softcapping=2.0)
        return Gemma2Config(**{**_decoder(**extra), **overrides})
    raise AssertionError(arch)


def _model(arch: str, attn: str, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(_config(arch, **overrides), attn_implementation=attn).train()


def _batch(*, pad: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    input_ids = torch.randint(3, VOCAB, (2, SEQ), generator=generator)
    labels = input_ids.clone()
    labels[0, :3] = hf.IGNORE_INDEX
    labels[1, 8] = hf.IGNORE_INDEX  # first label of a chunk in the k=2 split
    if pad is not None:
        input_ids[0, -3:] = pad  # right padding
        input_ids[1, :2] = pad  # left padding
        labels[input_ids == pad] = hf.IGNORE_INDEX
        # A padding position is a fully masked query row, whose output HF
        # makes uniform over all keys (future ones too): do not train on it.
        labels[:, 1:][input_ids[:, :-1] == pad] = hf.IGNORE_INDEX
    return input_ids, labels


def _stages(specs: list[LayerSpec]) -> tuple[list[Step], list[Step]]:
    """Build the layers (tied ones once, as one rank holding both ends would) and cut them in two."""
    tied: dict[str, torch.nn.Module] = {}
    steps: list[Step] = []
    for spec in specs:
        if isinstance(spec, TiedLayerSpec):
            module = tied.setdefault(spec.key, spec.build())
            steps.append(functools.partial(spec.forward_fn, module) if spec.forward_fn else module)
        else:
            steps.append(spec.build())
    blocks = sum(spec.typename is hf.HFDecoderBlock for spec in specs)
    cut = 1 + blocks // 2
    return steps[:cut], steps[cut:]


def _parameters(steps: Sequence[Step]) -> list[torch.nn.Parameter]:
    modules = [step.args[0] if isinstance(step, functools.partial) else step for step in steps]
    unique = {id(p): p for module in modules for p in module.parameters()}
    return list(unique.values())


def _run(steps: Sequence[Step], inputs: Any) -> Any:
    for step in steps:
        inputs = step(inputs)
    return inputs


@dataclass
class _Chunk:
    start: int
    end: int
    hidden: torch.Tensor  # stage-1 output
    received: torch.Tensor  # stage-2 input: a fresh leaf, as after a pipeline send
    logits: torch.Tensor
    loss: torch.Tensor


def _chunked_step(
    stages: tuple[list[Step], list[Step]],
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    bounds: list[int],
    *,
    use_roots: bool = True,
    split: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward chunks 0..k-1 through both stages, then backward k-1..0; returns (logits, loss)."""
    targets = F.pad(labels, (0, 1), value=hf.IGNORE_INDEX)[:, 1:]  # shifted once for the whole sequence
    total = (targets != hf.IGNORE_INDEX).sum()
    states = (hf.ChunkKVState(), hf.ChunkKVState())
    chunks = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        with hf.seq_chunk(states[0], start=start, end=end):
            hidden, key_mask = _run(stages[0], input_ids[:, start:end])
        received = hidden.detach().requires_grad_(True)
        with hf.seq_chunk(states[1], start=start, end=end):
            logits = _run(stages[1], (received, key_mask))
        flat = logits.reshape(-1, VOCAB)
        loss = F.cross_entropy(flat, targets[:, start:end].reshape(-1), reduction="sum") / total
        chunks.append(_Chunk(start, end, hidden, received, logits, loss))
    weight_passes: list[Callable[[], None]] | None = [] if split else None
    params = (_parameters(stages[0]), _parameters(stages[1]))
    for index in reversed(range(len(chunks))):
        chunk = chunks[index]
        ones = torch.ones_like(chunk.loss)
        _stage_backward(states[1], index, chunk.loss, ones, chunk.received, use_roots, weight_passes, params[1])
        assert chunk.received.grad is not None
        grad = chunk.received.grad
        _stage_backward(states[0], index, chunk.hidden, grad, None, use_roots, weight_passes, params[0])
    for weight_pass in weight_passes or []:  # deferred weight gradients, as zero-bubble schedules do
        weight_pass()
    logits = torch.cat([chunk.logits for chunk in chunks], dim=1)
    return logits.detach(), sum(chunk.loss.detach() for chunk in chunks)  # type: ignore[return-value]


def _stage_backward(
    state: hf.ChunkKVState,
    index: int,
    output: torch.Tensor,
    grad: torch.Tensor,
    stage_input: torch.Tensor | None,
    use_roots: bool,
    weight_passes: list[Callable[[], None]] | None,
    params: list[torch.nn.Parameter],
) -> None:
    """One stage's backward of one chunk; split into input and (deferred) weight passes when asked."""
    tensors, grads = state.backward_roots(index) if use_roots else ([], [])
    roots, root_grads = [output, *tensors], [grad, *grads]
    if weight_passes is None:
        torch.autograd.backward(roots, root_grads)
    else:
        inputs = [*([stage_input] if stage_input is not None else []), *state.kv_leaves(index)]
        if inputs:
            torch.autograd.backward(roots, root_grads, inputs=inputs, retain_graph=True)
        weight_passes.append(lambda: torch.autograd.backward(roots, root_grads, inputs=params))
    state.release(index)


BOUNDS = {"k2": [0, 8, 16], "k3": [0, 5, 9, 16], "k4": [0, 1, 2, 7, 16]}


def _check_against_model(
    model: PreTrainedModel, bounds: list[int], *, pad: int | None = None, split: bool = False
) -> None:
    reference = copy.deepcopy(model)
    input_ids, labels = _batch(pad=pad)
    mask = {} if pad is None else {"attention_mask": (input_ids != pad).long()}
    expected = reference(input_ids, labels=labels, **mask)
    expected.loss.backward()
    specs, _ = hf.pipeline_layers(model)
    logits, loss = _chunked_step(_stages(specs), input_ids, labels, bounds, split=split)
    real = (input_ids != pad) if pad is not None else torch.ones_like(input_ids, dtype=torch.bool)
    # Fully masked (padding) query rows are not comparable: they attend to different key sets.
    torch.testing.assert_close(logits[real], expected.logits.detach()[real], rtol=0, atol=TOL)
    assert abs(loss.item() - expected.loss.item()) < TOL
    ours, theirs = dict(model.named_parameters()), dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad, theirs[name].grad, rtol=0, atol=TOL, msg=name)


@pytest.mark.parametrize("bounds", BOUNDS.values(), ids=BOUNDS.keys())
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "gpt2", "gpt_neox"])
def test_chunked_pipeline_matches_model(arch: str, attn: str, bounds: list[int]) -> None:
    _check_against_model(_model(arch, attn), bounds)


@pytest.mark.parametrize(("arch", "attn"), [("granite", "eager"), ("granite", "sdpa"), ("gemma2", "eager")])
def test_chunked_post_processed_logits_match_model(arch: str, attn: str) -> None:
    # Each chunk's logits get the LM's own post-processing (scaling, soft-capping) on the last stage.
    _check_against_model(_model(arch, attn), BOUNDS["k3"])


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_chunked_padding_matches_attention_mask(attn: str) -> None:
    _check_against_model(_model("llama", attn, pad_token_id=0), BOUNDS["k3"], pad=0)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_split_backward_with_kv_leaves_matches_model(arch: str) -> None:
    # Input-gradient passes restricted by inputs= (stage input + kv_leaves), weight passes deferred.
    _check_against_model(_model(arch, "sdpa"), BOUNDS["k3"], split=True)


def test_gradients_need_the_backward_roots() -> None:
    # Control: without the later chunks' K/V gradients the weights' gradients are wrong.
    model = _model("llama", "sdpa")
    reference = copy.deepcopy(model)
    input_ids, labels = _batch()
    reference(input_ids, labels=labels).loss.backward()
    _chunked_step(_stages(hf.pipeline_layers(model)[0]), input_ids, labels, BOUNDS["k2"], use_roots=False)
    param, expected = model.model.layers[0].self_attn.k_proj.weight, reference.model.layers[0].self_attn.k_proj.weight
    assert param.grad is not None and expected.grad is not None
    assert not torch.allclose(param.grad, expected.grad, atol=1e-4)


def test_unchunked_layers_are_unchanged_outside_the_context() -> None:
    model = _model("llama", "sdpa")
    input_ids, _ = _batch()
    first, second = _stages(hf.pipeline_layers(model)[0])
    with torch.no_grad():
        torch.testing.assert_close(_run(second, _run(first, input_ids)), model(input_ids).logits, rtol=0, atol=0)


def _two_chunks_on_one_stage(state: hf.ChunkKVState) -> list[torch.Tensor]:
    model = _model("llama", "eager")
    first, _ = _stages(hf.pipeline_layers(model)[0])
    input_ids, _ = _batch()
    outputs = []
    for start, end in ((0, 8), (8, 16)):
        with hf.seq_chunk(state, start=start, end=end):
            outputs.append(_run(first, input_ids[:, start:end])[0])
    return outputs


def test_backward_out_of_order_is_refused() -> None:
    state = hf.ChunkKVState()
    _two_chunks_on_one_stage(state)
    assert state.num_chunks == 2
    with pytest.raises(RuntimeError, match=r"chunk 0 before the backward of later chunk\(s\) \[1\]"):
        state.backward_roots(0)
    with pytest.raises(RuntimeError, match="descending chunk order"):
        state.release(0)


def test_forward_after_backward_began_and_reuse_are_refused() -> None:
    state = hf.ChunkKVState()
    outputs = _two_chunks_on_one_stage(state)
    tensors, grads = state.backward_roots(1)
    assert tensors == [] and grads == []  # the last chunk receives no K/V gradients
    outputs[1].sum().backward()
    with pytest.raises(RuntimeError, match="after a backward began"):
        with hf.seq_chunk(state, start=16, end=20):
            pass
    with pytest.raises(RuntimeError, match=r"chunk\(s\) \[0, 1\] still await backward"):
        with hf.seq_chunk(state, start=0, end=4):
            pass
    state.release(1)
    tensors, grads = state.backward_roots(0)
    assert len(tensors) == len(grads) == 2  # K and V of the stage's one block
    # Gradient edges of chunk 0's own K/V (their values live on in the buffers), fed chunk 1's gradients.
    assert all(isinstance(t, GradientEdge) for t in tensors)
    assert all(g.shape[-2] == 8 for g in grads)  # chunk 0 holds positions [0, 8)


def test_chunk_inputs_must_match_bounds() -> None:
    model = _model("llama", "eager")
    first, _ = _stages(hf.pipeline_layers(model)[0])
    input_ids, _ = _batch()
    with pytest.raises(ValueError, match="needs inputs of 8 positions, got 16"):
        with hf.seq_chunk(hf.ChunkKVState(), start=0, end=8):
            _run(first, input_ids)


def test_unverified_attention_implementation_is_refused() -> None:
    model = _model("llama", "sdpa")
    first, _ = _stages(hf.pipeline_layers(model)[0])
    model.config._attn_implementation = "flex_attention"  # e.g. switched after the layers were made
    input_ids, _ = _batch()
    with pytest.raises(ValueError, match=r"model type 'llama' cannot run in sequence chunks: .*'flex_attention'"):
        with hf.seq_chunk(hf.ChunkKVState(), start=0, end=8):
            _run(first, input_ids[:, :8])


def test_length_dependent_rotary_is_refused() -> None:
    # pipeline_layers cannot trace these today (they read tensor values); the
    # chunk check refuses them on its own, for when it can.
    factors = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4, "original_max_position_embeddings": 32}
    for rope_type, extra in (("dynamic", {}), ("longrope", factors)):
        rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0, **extra}
        config = _config("llama", rope_parameters=rope)
        config._attn_implementation = "sdpa"
        reason = hf_chunkable.chunk_refusal(config, None)
        assert reason is not None and rope_type in reason and "sequence length" in reason
    plain = _config("llama")
    plain._attn_implementation = "eager"
    assert hf_chunkable.chunk_refusal(plain, None) is None


def _saved_bytes(run: Callable[[], Any], params: set[int]) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``run`` runs (parameters left out)."""
    seen: dict[int, int] = {}
    alive: list[Any] = []  # a chunk's graph may be freed before the next runs: hold its storages so no address is reused

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
            alive.append(storage)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


@pytest.mark.parametrize("total", [SEQ, None], ids=["whole-length-known", "growing"])
def test_chunks_keep_keys_and_values_once(total: int | None) -> None:
    # SDPA saves the keys/values it attends to. With the whole length known, every chunk attends to a
    # view of one buffer per layer, so the chunks of a micro-batch save what the unchunked stage saves
    # (plus the small causal masks); without it, the buffer moves each chunk, one prefix copy per chunk.
    model = _model("llama", "sdpa", num_key_value_heads=4, hidden_size=64, intermediate_size=64)
    first, _ = _stages(hf.pipeline_layers(model)[0])
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    input_ids, _ = _batch()
    whole = _saved_bytes(lambda: _run(first, input_ids), params)
    state, bounds = hf.ChunkKVState(), BOUNDS["k4"]

    def chunked() -> None:
        for start, end in zip(bounds[:-1], bounds[1:]):
            with hf.seq_chunk(state, start=start, end=end, total=total if start == 0 else None):
                _run(first, input_ids[:, start:end])

    saved = _saved_bytes(chunked, params)
    masks = sum(4 * (end - start) * end for start, end in zip(bounds[:-1], bounds[1:]))  # fp32 [queries, keys] each
    layers = sum(isinstance(step, hf.HFDecoderBlock) for step in first)
    if total is not None:
        assert saved <= whole + layers * masks
    else:
        assert saved > whole + layers * masks


class _SDPAMasks(TorchFunctionMode):
    """Records the type of each ``attn_mask`` given to SDPA (the outer call: a mode is off while it runs)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[type] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            self.seen.append(type(kwargs.get("attn_mask")))
        return func(*args, **kwargs)


@pytest.mark.parametrize("pad", [None, 0], ids=["no-padding", "padding"])
def test_sdpa_gets_a_lower_right_causal_bias_unless_padding_needs_the_mask(pad: int | None) -> None:
    # HF would materialise a [batch, 1, queries, keys] mask, which SDPA saves in every layer.
    model = _model("llama", "sdpa", **({} if pad is None else {"pad_token_id": pad}))
    first, _ = _stages(hf.pipeline_layers(model)[0])
    input_ids, _ = _batch(pad=pad)
    state = hf.ChunkKVState()
    with hf.seq_chunk(state, start=0, end=8):
        _run(first, input_ids[:, :8])
    masks = _SDPAMasks()
    with hf.seq_chunk(state, start=8, end=16), masks:
        _run(first, input_ids[:, 8:])
    assert len(masks.seen) == sum(isinstance(step, hf.HFDecoderBlock) for step in first) > 0
    want = torch.Tensor if pad is not None else CausalBias
    assert all(kind is want for kind in masks.seen), masks.seen
