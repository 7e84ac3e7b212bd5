"""ds_vshape.hf: pipeline layers of tiny HF causal LMs reproduce the model exactly."""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import copy
import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from safetensors import safe_open
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    LlamaForCausalLM,
    BertConfig,
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
    T5Config,
)

from ds_vshape import hf
from ds_vshape.hf import analysis as hf_analysis
from ds_vshape.hf import pass_memo as hf_pass_memo
from ds_vshape.hf import tracing as hf_tracing
from ds_vshape.hf import weights as hf_weights

VOCAB = 128
TOL = 1e-5

# Where each architecture keeps its parts (only used to state expectations).
ANATOMY = {
    "gpt2": {"layers": "transformer.h", "prologue": "transformer.", "epilogue": ("transformer.ln_f.", "lm_head.")},
    "llama": {"layers": "model.layers", "prologue": "model.", "epilogue": ("model.norm.", "lm_head.")},
    "mistral": {"layers": "model.layers", "prologue": "model.", "epilogue": ("model.norm.", "lm_head.")},
    "qwen2": {"layers": "model.layers", "prologue": "model.", "epilogue": ("model.norm.", "lm_head.")},
    "qwen3": {"layers": "model.layers", "prologue": "model.", "epilogue": ("model.norm.", "lm_head.")},
    "gpt_neox": {"layers": "gpt_neox.layers", "prologue": "gpt_neox.",
                 "epilogue": ("gpt_neox.final_layer_norm.", "embed_out.")},
    "granite": {"layers": "model.layers", "prologue": "model.", "epilogue": ("model.norm.", "lm_head.")},
    "gemma2": {"layers": "model.layers", "prologue": "model.", "epilogue": ("model.norm.", "lm_head.")},
}


def _decoder(**extra: Any) -> dict[str, Any]:
    return dict(
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=VOCAB,
        max_position_embeddings=64,
        **extra,
    )


def make_config(arch: str, **overrides: Any) -> PretrainedConfig:
    if arch == "gpt2":  # learned position embeddings, tied head, LayerNorm
        kwargs = dict(n_embd=32, n_layer=2, n_head=4, n_positions=64, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
        kwargs.update(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return GPT2Config(**{**kwargs, **overrides})
    if arch == "llama":  # rotary, RMSNorm, untied head
        return LlamaConfig(**{**_decoder(num_hidden_layers=3), **overrides})
    if arch == "mistral":  # sliding window (4) shorter than the test sequences
        return MistralConfig(**{**_decoder(num_hidden_layers=2, sliding_window=4), **overrides})
    if arch == "qwen2":  # full attention in layers 0-1, sliding in 2-3; tied head
        extra = dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=4, max_window_layers=2)
        return Qwen2Config(**{**_decoder(**extra, tie_word_embeddings=True), **overrides})
    if arch == "qwen3":  # per-head q/k norms
        return Qwen3Config(**{**_decoder(num_hidden_layers=2, head_dim=8), **overrides})
    if arch == "gpt_neox":  # partial rotary, parallel residual, blocks take the cache as layer_past
        kwargs = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=VOCAB, max_position_embeddings=64, attention_dropout=0.0, hidden_dropout=0.0)
        return GPTNeoXConfig(**{**kwargs, **overrides})
    if arch == "granite":  # multipliers everywhere; the LM divides its logits by logits_scaling
        extra = dict(num_hidden_layers=2, logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                     attention_multiplier=0.3)
        return GraniteConfig(**{**_decoder(**extra), **overrides})
    if arch == "gemma2":  # alternating sliding/full layers, attention and final logit soft-capping, tied head
        extra = dict(num_hidden_layers=4, head_dim=8, sliding_window=4, final_logit_softcapping=2.0)
        return Gemma2Config(**{**_decoder(**extra), **overrides})
    raise AssertionError(arch)


def make_model(arch: str, **overrides: Any) -> PreTrainedModel:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config(arch, **overrides))
    return model.train()  # dropout probabilities are zero: train mode is deterministic


def make_batch(seed: int, batch: int = 3, seq: int = 11) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(3, VOCAB, (batch, seq), generator=generator)
    labels = input_ids.clone()
    labels[0, :4] = hf.IGNORE_INDEX  # e.g. a prompt that is not trained on
    labels[1, 6] = hf.IGNORE_INDEX
    return input_ids, labels


class Sequential:
    """Runs layer specs in order on one process, building each like PipelineModule does."""

    def __init__(self, specs: list[LayerSpec]) -> None:
        self.modules: list[nn.Module] = []
        self.steps: list[Callable[[Any], Any]] = []
        tied: dict[str, nn.Module] = {}
        for spec in specs:
            if isinstance(spec, TiedLayerSpec):
                if spec.key not in tied:  # one module per key, shared by both ends
                    tied[spec.key] = spec.build()
                    self.modules.append(tied[spec.key])
                module = tied[spec.key]
                self.steps.append(functools.partial(spec.forward_fn, module) if spec.forward_fn else module)
            else:
                self.modules.append(spec.build())
                self.steps.append(self.modules[-1])

    def __call__(self, inputs: Any) -> Any:
        for step in self.steps:
            inputs = step(inputs)
        return inputs

    def parameters(self) -> Iterator[nn.Parameter]:
        seen: set[int] = set()
        for module in self.modules:
            for param in module.parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield param


ARCHS = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gpt_neox", "granite", "gemma2"]


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_reproduce_model_logits_and_loss(arch: str) -> None:
    model = make_model(arch)
    specs, loss_fn = hf.pipeline_layers(model)
    input_ids, labels = make_batch(0)
    with torch.no_grad():
        reference = model(input_ids, labels=labels)
        logits = Sequential(specs)(input_ids)
    assert logits.shape == (3, 11, VOCAB)
    torch.testing.assert_close(logits, reference.logits, rtol=0, atol=TOL)
    assert abs(loss_fn(logits, labels).item() - reference.loss.item()) < TOL


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_interface(arch: str) -> None:
    model = make_model(arch)
    specs, _ = hf.pipeline_layers(model)
    kinds = [spec.typename for spec in specs]
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (arch in ("gpt2", "qwen2", "gemma2"))
    blocks = [hf.HFDecoderBlock] * model.config.num_hidden_layers
    if tied:
        assert kinds == [hf.HFEmbedding, *blocks, hf.HFFinalNorm, hf.HFEmbedding]
        assert isinstance(specs[0], TiedLayerSpec) and isinstance(specs[-1], TiedLayerSpec)
        assert specs[0].key == specs[-1].key == "embed"
    else:
        assert kinds == [hf.HFEmbedding, *blocks, hf.HFLMHead]
    input_ids, _ = make_batch(1)
    out = specs[0].build()((input_ids,))  # a 1-tuple works like the bare tensor
    assert isinstance(out, tuple) and len(out) == 2
    hidden, key_mask = out
    assert hidden.is_floating_point() and hidden.shape == (3, 11, 32)
    assert key_mask.dtype == torch.long and not key_mask.requires_grad and bool((key_mask == 1).all())


def test_tied_weight_attr_points_at_the_shared_embedding() -> None:
    model = make_model("gpt2")
    specs, _ = hf.pipeline_layers(model)
    first, last = specs[0], specs[-1]
    assert first.tied_weight_attr == last.tied_weight_attr
    module = first.build()
    # The attribute path DeepSpeed uses to all-reduce the tied gradient.
    weight = PipelineModule._recursive_getattr(module, first.tied_weight_attr[0])
    assert weight is model.transformer.wte.weight is model.lm_head.weight


def test_sliding_window_is_exercised() -> None:
    # Guard for the Mistral/Qwen2 cases: with these shapes the window matters.
    model = make_model("mistral")
    full = make_model("mistral", sliding_window=None)
    full.load_state_dict(model.state_dict())
    input_ids, _ = make_batch(2)
    with torch.no_grad():
        assert not torch.allclose(model(input_ids).logits, full(input_ids).logits, atol=1e-4)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_padding_is_masked_like_attention_mask(arch: str) -> None:
    model = make_model(arch, pad_token_id=0)
    input_ids, labels = make_batch(3)
    input_ids[0, -4:] = 0  # right padding
    input_ids[2, :3] = 0  # left padding
    labels[input_ids == 0] = hf.IGNORE_INDEX
    attention_mask = (input_ids != 0).long()
    specs, loss_fn = hf.pipeline_layers(model)
    with torch.no_grad():
        reference = model(input_ids, attention_mask=attention_mask, labels=labels)
        logits = Sequential(specs)(input_ids)
    torch.testing.assert_close(logits, reference.logits, rtol=0, atol=TOL)
    assert abs(loss_fn(logits, labels).item() - reference.loss.item()) < TOL
    # The padding really changes the result, and can be switched off.
    unmasked_specs, _ = hf.pipeline_layers(model, mask_padding=False)
    with torch.no_grad():
        unmasked = Sequential(unmasked_specs)(input_ids)
        torch.testing.assert_close(unmasked, model(input_ids).logits, rtol=0, atol=TOL)
    assert not torch.allclose(unmasked, logits, atol=1e-4)


class CountingSafeOpen:
    """safe_open wrapper recording every tensor read."""

    reads: ClassVar[list[str]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._handle = safe_open(*args, **kwargs)

    def __enter__(self) -> CountingSafeOpen:
        self._inner = self._handle.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._handle.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self._inner.keys())

    def get_tensor(self, key: str) -> torch.Tensor:
        CountingSafeOpen.reads.append(key)
        return self._inner.get_tensor(key)


def _checkpoint_keys(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as handle:
        return set(handle.keys())


def _expected_reads(arch: str, spec: LayerSpec, keys: set[str], index: int) -> set[str]:
    parts = ANATOMY[arch]
    if spec.typename is hf.HFDecoderBlock:
        block = f"{parts['layers']}.{spec.module_args[1]}."
        return {k for k in keys if k.startswith(block)}
    if spec.typename is hf.HFEmbedding and index == 0:
        body = {k for k in keys if k.startswith(parts["prologue"])}
        return {k for k in body if not k.startswith((parts["layers"] + ".", *parts["epilogue"]))}
    if spec.typename is hf.HFEmbedding:
        return set()  # the tied head reuses the module built for layer 0
    return {k for k in keys if k.startswith(parts["epilogue"])}


@pytest.mark.parametrize("arch", ARCHS)
def test_directory_source_reads_only_own_weights(arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model(arch)
    model.save_pretrained(tmp_path)
    keys = _checkpoint_keys(tmp_path)
    monkeypatch.setattr(hf_weights, "safe_open", CountingSafeOpen)
    CountingSafeOpen.reads = []
    specs, loss_fn = hf.pipeline_layers(tmp_path)
    assert CountingSafeOpen.reads == []  # planning reads no tensor
    built_from_instance = [spec.build() for spec in hf.pipeline_layers(model)[0]]
    assert hf.parameter_counts(specs) == [sum(p.numel() for p in m.parameters()) for m in built_from_instance]
    assert CountingSafeOpen.reads == []  # counting parameters reads none either
    tied: dict[str, nn.Module] = {}
    every_read: list[str] = []
    for index, spec in enumerate(specs):
        CountingSafeOpen.reads = []
        if not isinstance(spec, TiedLayerSpec):
            spec.build()
        elif spec.key not in tied:  # PipelineModule builds a tied key once per rank
            tied[spec.key] = spec.build()
        assert set(CountingSafeOpen.reads) == _expected_reads(arch, spec, keys, index), spec
        every_read += CountingSafeOpen.reads
    assert sorted(every_read) == sorted(keys)  # every stored tensor read exactly once overall

    input_ids, labels = make_batch(4)
    with torch.no_grad():
        reference = model(input_ids, labels=labels)
        logits = Sequential(specs)(input_ids)
    torch.testing.assert_close(logits, reference.logits, rtol=0, atol=TOL)
    assert abs(loss_fn(logits, labels).item() - reference.loss.item()) < TOL


def _train(step: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], params: list[nn.Parameter]) -> list[float]:
    optimizer = torch.optim.SGD(params, lr=0.5)
    losses = []
    for seed in range(3):
        input_ids, labels = make_batch(10 + seed)
        optimizer.zero_grad()
        loss = step(input_ids, labels)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("source", ["instance", "directory"])
@pytest.mark.parametrize("arch", ARCHS)
def test_sgd_steps_match_model(arch: str, source: str, tmp_path: Path) -> None:
    model = make_model(arch)
    reference = copy.deepcopy(model)
    if source == "directory":
        model.save_pretrained(tmp_path)
    specs, loss_fn = hf.pipeline_layers(model if source == "instance" else tmp_path)
    pipeline = Sequential(specs)
    params = list(pipeline.parameters())
    if source == "instance":  # the layers are the model's own modules: every weight, once
        assert {id(p) for p in params} == {id(p) for p in model.parameters()}
    assert sum(p.numel() for p in params) == sum(p.numel() for p in reference.parameters())

    expected = _train(lambda ids, labels: reference(ids, labels=labels).loss, list(reference.parameters()))
    got = _train(lambda ids, labels: loss_fn(pipeline(ids), labels), params)
    assert expected[0] != expected[-1]  # the steps did change the weights
    assert got == pytest.approx(expected, abs=TOL)


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_config_source_uses_the_models_own_init(arch: str) -> None:
    config = make_config(arch)
    specs, loss_fn = hf.pipeline_layers(config, attn_implementation="eager")
    pipeline = Sequential(specs)
    model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in pipeline.parameters()) == sum(p.numel() for p in model.parameters())
    norms = [p for m in pipeline.modules for n, p in m.named_parameters() if p.dim() == 1 and "weight" in n]
    assert norms and all(bool((p == 1).all()) for p in norms)  # norm weights start at one, as HF inits them
    embedding = specs[0].build().body.get_input_embeddings().weight
    assert abs(embedding.std().item() - config.initializer_range) < 0.005
    input_ids, labels = make_batch(5)
    loss = loss_fn(pipeline(input_ids), labels)
    assert abs(loss.item() - torch.log(torch.tensor(float(VOCAB))).item()) < 0.2  # near-uniform at init


def test_causal_lm_loss_matches_manual_shift() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=generator)
    labels = torch.tensor([[1, 2, -100, 3, 4], [-100, -100, 5, 6, 0]])
    targets = labels[:, 1:].reshape(-1)
    kept = targets != -100
    manual = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 7)[kept], targets[kept])
    assert torch.allclose(hf.causal_lm_loss(logits, labels), manual)
    assert torch.allclose(hf.causal_lm_loss(logits, (labels,)), manual)


def test_encoder_only_model_is_rejected() -> None:
    config = BertConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB
    )
    with pytest.raises(ValueError, match="bidirectional"):
        hf.pipeline_layers(config)


def test_encoder_decoder_config_is_rejected() -> None:
    with pytest.raises(ValueError, match="no causal-LM class"):
        hf.pipeline_layers(T5Config(d_model=32, d_ff=64, num_layers=2, num_heads=4, vocab_size=VOCAB))


POST_PROCESSING = {  # config that turns it off, and the calls recorded with it on
    "granite": ({"logits_scaling": 1.0}, "LogitOps(div)"),
    "gemma2": ({"final_logit_softcapping": None}, "LogitOps(div, tanh, mul)"),
}


@pytest.mark.parametrize("arch", POST_PROCESSING)
def test_logit_post_processing_is_replayed_exactly(arch: str) -> None:
    # Granite divides the head's output by logits_scaling, Gemma2 soft-caps it: the last layer
    # replays what the LM's own forward does (the parity itself is test_layers_reproduce_...).
    plain, recorded = POST_PROCESSING[arch]
    model = make_model(arch)
    specs, _ = hf.pipeline_layers(model)
    input_ids, _ = make_batch(7)
    without = make_model(arch, **plain)
    without.load_state_dict(model.state_dict())
    with torch.no_grad():
        logits = Sequential(specs)(input_ids)
        torch.testing.assert_close(logits, model(input_ids).logits, rtol=0, atol=TOL)
        assert not torch.allclose(logits, without(input_ids).logits, atol=1e-3)  # the post-processing matters here
    assert repr(specs[-1].module_args[0].logit_ops) == recorded


class _OffsetLogits(LlamaForCausalLM):
    """A causal LM adding a stored tensor to its logits: not recomputable from the head's output alone."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config)
        self.register_buffer("offset", torch.ones(config.vocab_size))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits + self.offset
        return out


class _RunningLogits(LlamaForCausalLM):
    """A causal LM whose logits at a position depend on the earlier positions' logits."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        out = super().forward(*args, **kwargs)
        out.logits = out.logits.cumsum(dim=1)
        return out


def test_post_processing_that_cannot_be_replayed_is_refused() -> None:
    config = make_config("llama")
    with pytest.raises(ValueError, match=r"cannot be recomputed from the LM head's output \(combined with other "
                                         r"tensors in .*add"):
        hf.pipeline_layers(_OffsetLogits(config))
    with pytest.raises(ValueError, match="mixes positions or sequences"):
        hf.pipeline_layers(_RunningLogits(config))


def test_instance_options_are_rejected() -> None:
    with pytest.raises(ValueError, match="attn_implementation"):
        hf.pipeline_layers(make_model("llama"), attn_implementation="eager")
    with pytest.raises(TypeError):
        hf.pipeline_layers(42)  # type: ignore[arg-type]


def test_only_position_dependent_outputs_are_recomputed_per_block() -> None:
    # Rebuilding a block argument on a later stage re-runs its weight-free
    # producer on that stage's hidden state: fine for rotary embeddings (only
    # shape/dtype used), wrong for anything reading the values.
    class ValueDependent(nn.Module):
        def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x * 2, position_ids.float()

    recipe = hf_tracing.Recipe(
        (hf_tracing.Arg("x", hf_tracing.Kind.HIDDEN),),
        (hf_tracing.Arg("position_ids", hf_tracing.Kind.POSITIONS),),
    )
    example = torch.empty(2, 5, 32, device="meta")
    with pytest.raises(ValueError, match="depends on hidden-state values"):
        hf_analysis._check_position_only(ValueDependent(), recipe, "value_dependent", example=example)
    rotary = make_model("llama").model.rotary_emb
    hf_analysis._check_position_only(rotary, recipe, "model.rotary_emb", example=example)  # accepted


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_blocks_of_one_pass_build_rotary_and_masks_once(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # As the model's own forward: once per pass for all blocks (gemma2: one sliding, one full mask), again
    # in the next pass, and the same logits and gradients as building them in every block.
    model = make_model(arch)
    specs, _ = hf.pipeline_layers(model)
    stage = Sequential(specs)
    blocks = [m for m in stage.modules if isinstance(m, hf.layers.HFDecoderBlock)]
    built = {"RopeRef": 0, "MaskRecipe": 0}
    once = hf_tracing.Runtime._once

    def counting(self: hf_tracing.Runtime, key: object, compute: Callable[[], Any], **kw: Any) -> Any:
        def counted() -> Any:
            built[type(key).__name__] += 1
            return compute()

        return once(self, key, counted, **kw)

    monkeypatch.setattr(hf_tracing.Runtime, "_once", counting)
    in_block = [{id(a.value) for a in (*b._recipe.positional, *b._recipe.keyword) if a.kind is hf_tracing.Kind.MASK}
                for b in blocks]
    masks = len(set().union(*in_block))
    input_ids, _ = make_batch(1)

    def logits_and_grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = stage(input_ids)
        grads = torch.autograd.grad(logits.square().sum(), [p for p in stage.parameters() if p.requires_grad])
        return logits.detach(), list(grads)

    shared = logits_and_grads()
    assert built == {"RopeRef": 1, "MaskRecipe": masks} and masks == (2 if arch == "gemma2" else 1)
    logits_and_grads()
    assert built == {"RopeRef": 2, "MaskRecipe": 2 * masks}
    monkeypatch.setattr(hf.attention, "pass_memo", lambda *_: None)  # every block builds its own
    per_block = logits_and_grads()
    assert built == {"RopeRef": 2 + len(blocks), "MaskRecipe": 2 * masks + sum(map(len, in_block))}
    assert torch.equal(shared[0], per_block[0]) and all(torch.equal(a, b) for a, b in zip(shared[1], per_block[1]))


@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_later_passes_take_the_rotary_output_of_the_latest_pass(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # A V or interleaved schedule runs a rank's blocks in more passes, each on positions 0..s-1: the rotary
    # module runs in the first pass only, with the same logits and gradients as running it in every pass.
    model = make_model(arch)
    specs, _ = hf.pipeline_layers(model)
    stage = Sequential(specs)
    rope_cls, calls = type(model.model.rotary_emb), []
    forward = rope_cls.forward

    @functools.wraps(forward)
    def counting(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        calls.append(self)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(rope_cls, "forward", counting)
    input_ids, _ = make_batch(1)

    def logits_and_grads(ids: torch.Tensor = input_ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
        logits = stage(ids)
        grads = torch.autograd.grad(logits.square().sum(), [p for p in stage.parameters() if p.requires_grad])
        return logits.detach(), list(grads)

    shared = logits_and_grads()
    assert len(calls) == 1
    again = logits_and_grads()
    assert len(calls) == 1  # a new pass (a new key mask), the same positions
    logits_and_grads(make_batch(2, seq=7)[0])
    assert len(calls) == 2  # other positions: built again
    monkeypatch.setattr(hf_tracing.Runtime, "ROTARY_ACROSS_PASSES", False)  # every pass builds its own
    per_pass = logits_and_grads()
    assert len(calls) == 3
    for got in (again, per_pass):
        assert torch.equal(shared[0], got[0]) and all(torch.equal(a, b) for a, b in zip(shared[1], got[1]))


def test_the_rotary_passes_benchmark_times_both_ways_and_restores_the_sharing(tmp_path: Path) -> None:
    """``benchmarks/rotary_passes.py`` (``make bench-host``), a few reps: a row per stage size, both ways."""
    from benchmarks import rotary_passes

    out = tmp_path / "rotary_passes.md"
    assert rotary_passes.main(["--blocks", "1", "2", "--seq-len", "8", "--reps", "3", "--warmup", "1", "--out", str(out)]) == 0
    rows = [line for line in out.read_text().splitlines() if line.startswith("| 1 |") or line.startswith("| 2 |")]
    assert len(rows) == 2 and all(line.count("|") == 6 for line in rows)
    assert hf_tracing.Runtime.ROTARY_ACROSS_PASSES is True


class _BufferRope(nn.Module):
    rope_type = "default"

    def __init__(self, *, trainable: bool = False) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.tensor([1.0, 0.5]), persistent=False)
        self.scale = nn.Parameter(torch.ones(())) if trainable else None
        self.calls = 0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls += 1
        angles = position_ids[..., None].float() * self.inv_freq
        if self.scale is not None:
            angles = angles * self.scale
        return angles.cos().to(x.dtype), angles.sin().to(x.dtype)


def test_the_rotary_output_is_built_again_when_what_it_was_built_from_changes() -> None:
    rope, recipe, hidden = _BufferRope(), object(), torch.zeros(2, 5, 4)

    def get(reference: torch.Tensor = hidden, module: nn.Module = rope, key: object = recipe) -> Any:
        return hf_pass_memo.rotary_across_passes(key, module, reference, lambda: module(reference, torch.arange(reference.shape[1])[None]))

    first = get()
    assert get() is first and rope.calls == 1
    with torch.no_grad():  # a reentrant checkpoint's forward: the same positions, the same output
        assert get() is first and rope.calls == 1

    def built_again(change: Callable[[], Any], module: _BufferRope = rope) -> Any:
        calls = module.calls
        out = change()
        assert module.calls == calls + 1, change
        assert change() is out and module.calls == calls + 1  # and kept for the next pass alike
        return out

    built_again(lambda: get(hidden.double()))  # the reference's dtype
    built_again(lambda: get(torch.zeros(2, 6, 4)))  # positions 0..5
    out = built_again(get)  # back to the first shape: built again (a module keeps its latest output only)
    out[0].add_(1.0)  # a consumer wrote it in place: not handed on
    fresh = built_again(get)
    assert torch.equal(fresh[0], _BufferRope()(hidden, torch.arange(5)[None])[0])
    fresh[1].untyped_storage().resize_(0)  # freed in place (as an offload frees what it moved): its version stays
    built_again(get)
    rope.inv_freq.mul_(2.0)  # its buffer written in place
    built_again(get)
    rope.double()  # its buffer replaced (another dtype)
    built_again(get)
    rope.attention_scaling = 2.0
    built_again(get)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        built_again(get)
    another = object()
    built_again(lambda: get(key=another))  # another recipe on the module
    other = _BufferRope()  # another module (another model)
    built_again(lambda: get(module=other), other)
    # Passes of two stages take turns (a V placement), each block holding its copy: each keeps its own.
    mine = get()  # (built: the module's latest was another recipe's)
    calls, other_calls = rope.calls, other.calls
    theirs = get(module=other)
    assert get() is mine and get(module=other) is theirs and get() is mine
    assert (rope.calls, other.calls) == (calls, other_calls)
    trainable = _BufferRope(trainable=True)  # an output that records history is never shared: its graph is its pass's
    get(module=trainable)
    get(module=trainable)
    nested = _BufferRope()
    nested.inner = nn.Identity()  # nor one of a module with submodules (whose tensors it does not read)
    get(module=nested)
    get(module=nested)
    plain = _BufferRope()
    with torch.inference_mode():  # nor an inference tensor (a training pass could not save it)
        get(module=plain)
        get(module=plain)
        inference = _BufferRope()  # nor anything from a module whose buffers have no version
        get(module=inference)
        get(module=inference)
    assert (trainable.calls, nested.calls, plain.calls, inference.calls) == (2, 2, 2, 2)


def test_pass_memo_keeps_the_latest_pass_only() -> None:
    key_mask, hidden = torch.ones(2, 5, dtype=torch.long), torch.zeros(2, 5, 8)
    memo = hf_pass_memo.pass_memo(key_mask, hidden)
    assert memo is not None and hf_pass_memo.pass_memo(key_mask, hidden.clone()) is memo
    others = [hf_pass_memo.pass_memo(key_mask.clone(), hidden), hf_pass_memo.pass_memo(key_mask, hidden.double()),
              hf_pass_memo.pass_memo(key_mask, torch.zeros(2, 4, 8))]
    with torch.no_grad():
        others.append(hf_pass_memo.pass_memo(key_mask, hidden))
    key_mask[0, 0] = 0  # written in place: what was built from it is stale
    others.append(hf_pass_memo.pass_memo(key_mask, hidden))
    assert all(other is not None and other is not memo for other in others)
    assert len({id(m) for m in others}) == len(others)
    assert hf_pass_memo.pass_memo(key_mask, hidden) is others[-1]
    del key_mask  # its pass's outputs go with it
    assert hf_pass_memo._LAST.memo is None
    with torch.inference_mode():  # no version counter to tell a key mask written in place
        assert hf_pass_memo.pass_memo(torch.ones(2, 5, dtype=torch.long), hidden) is None
    assert hf_pass_memo.pass_memo(None, hidden) is None


def test_a_memo_entry_keeps_its_recipe_so_no_other_recipe_takes_its_id() -> None:
    # A pass memo outlives the layers that filled it when another model runs on the same key mask (a
    # reference model and its pipeline copy, say): a recipe freed with its model must not leave its output
    # to whichever new recipe CPython puts at the freed address (a rotary pair handed over as a mask).
    memo: hf_pass_memo.Memo = {}
    runtime = hf_tracing.Runtime(memo=memo)
    built = [runtime._once(object(), lambda: ("cos", "sin")) for _ in range(3)] + [runtime._once(object(), lambda: "mask")]
    assert built == [("cos", "sin")] * 3 + ["mask"] and len(memo) == 4
    recipe = object()
    memo[id(recipe)] = (object(), "stale")  # an entry under this id from another recipe
    assert runtime._once(recipe, lambda: "fresh") == "fresh" and runtime._once(recipe, lambda: "again") == "fresh"


class _Rope(nn.Module):
    def __init__(self, rope_type: Any) -> None:
        super().__init__()
        self.rope_type, self.calls = rope_type, 0

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return position_ids.to(x.dtype)


@pytest.mark.parametrize(("rope_type", "shared"), [("default", True), ({"full": "yarn", "sliding": "default"}, True),
                                                   ("dynamic", False), ({"full": "dynamic", "sliding": "default"}, False),
                                                   (None, False)])
def test_only_history_free_rotary_outputs_are_shared(rope_type: Any, shared: bool) -> None:
    # A "dynamic" rotary module's frequencies follow the longest sequence it has seen (and a module of
    # unknown kind may keep anything): each block's copy must see every pass, as before.
    recipe = hf_tracing.Recipe((hf_tracing.Arg("x", hf_tracing.Kind.HIDDEN),),
                               (hf_tracing.Arg("position_ids", hf_tracing.Kind.POSITIONS),))
    ref = hf_tracing.RopeRef("rope", recipe)
    arg = hf_tracing.Arg("position_embeddings", hf_tracing.Kind.ROPE, ref)
    memo: hf_pass_memo.Memo = {}
    ropes = [_Rope(rope_type) for _ in range(3)]
    hidden = torch.zeros(2, 5, 4)
    outputs = [hf_tracing.Runtime(hidden=hidden, ropes={"rope": rope}, memo=memo)._resolve(arg) for rope in ropes]
    assert [rope.calls for rope in ropes] == ([1, 0, 0] if shared else [1, 1, 1])
    assert hf_pass_memo.history_free(ropes[0]) is shared and all(torch.equal(o, outputs[0]) for o in outputs)


def test_inference_mode_builds_per_block() -> None:
    # Inference tensors have no version counter: the blocks build their own, with the same logits.
    specs, _ = hf.pipeline_layers(make_model("llama"))
    stage = Sequential(specs)
    input_ids, _ = make_batch(2)
    with torch.no_grad():
        logits = stage(input_ids)
    with torch.inference_mode():
        torch.testing.assert_close(stage(input_ids), logits, rtol=0, atol=0)


def test_sharded_and_base_model_checkpoints(tmp_path: Path) -> None:
    model = make_model("llama", tie_word_embeddings=True)
    input_ids, labels = make_batch(6)
    with torch.no_grad():
        expected = model(input_ids, labels=labels).loss.item()
    sharded, base_only = tmp_path / "sharded", tmp_path / "base_only"
    model.save_pretrained(sharded, max_shard_size="20KB")
    model.model.save_pretrained(base_only)  # keys without the "model." prefix, no head (tied)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert not any(key.startswith("model.") for key in _checkpoint_keys(base_only))
    for directory in (sharded, base_only):
        specs, loss_fn = hf.pipeline_layers(directory)
        with torch.no_grad():
            assert abs(loss_fn(Sequential(specs)(input_ids), labels).item() - expected) < TOL
