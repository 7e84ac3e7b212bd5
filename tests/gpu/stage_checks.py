"""One rank's stage checks, written once for any device: the GPU tier runs them on CUDA
(tests/gpu/test_stage_one_gpu.py), tests/unit/test_stage_checks_cpu.py on the CPU with small
shapes, so that their logic is proven where no GPU is.

A "stage" is what one pipeline rank holds of a Hugging Face Llama cut by ``ds_vshape.hf``:
stage 0 the embedding and the first half of the decoder blocks, stage 1 the rest, the final
norm and the LM head. The passes run as ``ds_vshape``'s engine runs them: F under
``WeightGradStore.forward_of`` (and the activation meter's recording), B under ``deferring``
(input gradients only), W by ``run`` (the parked weight gradients).
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from contextlib import nullcontext
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from ds_vshape import hf
from ds_vshape.runtime.measuring.memory import ActivationMeter
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward

__all__ = [
    "BF16_ULPS",
    "LlamaShape",
    "SplitResult",
    "HostSyncs",
    "CudaMemory",
    "LastStage",
    "MemoryWindow",
    "MeterReading",
    "Stage",
    "Timing",
    "assert_bf16_close",
    "batch",
    "issue_and_time",
    "last_stage",
    "llama",
    "meter_counts",
    "meter_reading",
    "metered_forward",
    "split_stages",
    "split_vs_fused",
    "stage_passes",
    "storage_bytes",
    "warm_up",
]

# bf16 keeps 8 significant bits: one unit in the last place of x is at most 2**-7 * |x|.
BF16_ULP = 2.0**-7
BF16_ULPS = 2  # tolerance in ulps at the tensor's largest magnitude (assert_bf16_close says why)


@dataclass(frozen=True)
class LlamaShape:
    """A Llama decoder's sizes and one micro-batch's (grouped-query attention when kv_heads < heads)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int


def llama(shape: LlamaShape, device: torch.device, dtype: torch.dtype, *, seed: int = 0) -> PreTrainedModel:
    """A randomly initialised Llama causal LM (SDPA attention) in train mode on ``device``."""
    config = LlamaConfig(hidden_size=shape.hidden, intermediate_size=shape.intermediate, num_hidden_layers=shape.layers,
                         num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads, vocab_size=shape.vocab,
                         max_position_embeddings=max(64, shape.seq))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.to(device=device, dtype=dtype).train()


def batch(shape: LlamaShape, device: torch.device, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, labels) of one micro-batch; a few labels are ignored (-100), as padding would."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, shape.vocab, (shape.batch, shape.seq), generator=g)
    labels = ids.clone()
    labels[0, : shape.seq // 4] = hf.IGNORE_INDEX
    return ids.to(device), labels.to(device)


class Stage(nn.Module):
    """A contiguous run of pipeline layers, called in order (one pipeline stage)."""

    def __init__(self, layers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, inputs: Any) -> Any:
        for layer in self.layers:
            inputs = layer(inputs)
        return inputs


def split_stages(model: PreTrainedModel) -> tuple[Stage, Stage]:
    """The model's pipeline layers (its own modules, no copy) cut after half of the decoder blocks."""
    specs, _ = hf.pipeline_layers(model)
    assert all(getattr(spec, "forward_fn", None) is None for spec in specs), "a tied head: not this helper's model"
    layers = [spec.build() for spec in specs]
    cut = 1 + sum(isinstance(layer, hf.HFDecoderBlock) for layer in layers) // 2
    return Stage(layers[:cut]), Stage(layers[cut:])


# ---- a: split backward against a fused backward ------------------------------------------------

@dataclass
class SplitResult:
    """Gradients by parameter name (model's naming), and stage 1's input gradient per micro-batch."""

    params: dict[str, torch.Tensor]
    boundary: list[torch.Tensor]
    deferred_after_b: set[str]  # parameters whose gradient was still None after every B


def _fused(model: PreTrainedModel, data: list[tuple[torch.Tensor, torch.Tensor]]) -> SplitResult:
    """Plain autograd: per micro-batch one loss.backward() through both stages."""
    first, second = split_stages(model)
    boundary = []
    for ids, labels in data:
        hidden, key_mask = first(ids)
        hidden.retain_grad()
        loss = hf.causal_lm_loss(second((hidden, key_mask)), labels) / len(data)
        loss.backward()
        boundary.append(hidden.grad.detach().clone())
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return SplitResult(grads, boundary, set())


def _split(model: PreTrainedModel, data: list[tuple[torch.Tensor, torch.Tensor]]) -> SplitResult:
    """F, F, ..., then B per micro-batch (stage 1 then 0), then every W in reverse: zero-bubble style."""
    first, second = split_stages(model)
    store = WeightGradStore()
    enable_split_backward([first, second], store)
    losses, outputs, received = [], [], []
    for mb, (ids, labels) in enumerate(data):
        with store.forward_of((0, mb)):
            hidden, key_mask = first(ids)
        leaf = hidden.detach().requires_grad_(True)  # what stage 1 receives over the wire
        with store.forward_of((1, mb)):
            logits = second((leaf, key_mask))
        losses.append(hf.causal_lm_loss(logits, labels) / len(data))
        outputs.append(hidden)
        received.append(leaf)
    for mb in range(len(data)):
        with store.deferring((1, mb)):
            losses[mb].backward()
        with store.deferring((0, mb)):
            outputs[mb].backward(received[mb].grad)
    deferred = {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
    for key in reversed(store.pending()):
        store.run(key)
    assert store.pending() == [] and store.parked_bytes == 0
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return SplitResult(grads, [leaf.grad.detach().clone() for leaf in received], deferred)


def split_vs_fused(shape: LlamaShape, device: torch.device, dtype: torch.dtype,
                   *, micro_batches: int = 2) -> tuple[SplitResult, SplitResult]:
    """(split, fused) gradients of the same Llama (two copies) over the same micro-batches."""
    model = llama(shape, device, dtype)
    reference = copy.deepcopy(model)
    data = [batch(shape, device, seed=mb) for mb in range(micro_batches)]
    return _split(model, data), _fused(reference, data)


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    """``got`` within BF16_ULPS bf16 ulps of ``want``'s largest magnitude, element by element.

    The rule: split backward runs the same kernels on the same bf16 operands as a fused
    backward; what may differ is the order in which bf16-rounded partial results are summed
    (the residual stream's fan-in, micro-batches accumulating into ``.grad``, attention
    backward's atomic adds on a GPU). Each such reordering moves a sum by at most about one
    ulp of the largest magnitude summed, which is of the order of the tensor's largest entry;
    two ulps of it leave room for one reordering on each side and nothing more (a lost or
    doubled micro-batch, a missed W, moves gradients by tens of percent).
    """
    assert got.shape == want.shape and got.dtype == want.dtype, (name, got.shape, want.shape, got.dtype, want.dtype)
    scale = want.abs().max().float().item()
    bound = BF16_ULPS * BF16_ULP * scale
    worst = (got.float() - want.float()).abs().max().item()
    assert worst <= bound, f"{name}: split differs from fused by {worst:.3g} > {bound:.3g} ({BF16_ULPS} bf16 ulps of {scale:.3g})"


# ---- b: the activation meter against the device's own allocation counters ---------------------

def warm_up(stage: Stage, inputs: tuple[torch.Tensor, torch.Tensor]) -> None:
    """One forward and backward first: library workspaces (cuBLAS) and the allocator's cache are
    set up on first use and stay, and must not be charged to the measured forward."""
    hidden, key_mask = inputs
    out = stage((hidden.detach().requires_grad_(True), key_mask))
    out.float().sum().backward()
    stage.zero_grad(set_to_none=True)


def storage_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(seen.values())


def metered_forward(stage: Stage, inputs: tuple[torch.Tensor, torch.Tensor], store: WeightGradStore | None,
                    *, key: Hashable = (1, 0)) -> tuple[Any, ActivationMeter]:
    """One F of ``stage`` as the engine runs it when measuring: under the meter's recording and,
    for a split-backward schedule (``store`` given), the store's routing. Returns (output, meter)."""
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in stage.parameters()})
    with meter.recording(), store.forward_of(key) if store is not None else nullcontext():
        out = stage(inputs)
    return out, meter


def meter_counts(meter: ActivationMeter, *, before: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> tuple[int, int]:
    """(what the meter counted that the forward allocated, bytes of outputs nothing saved).

    The meter also counts tensors that existed before the forward (the stage input, buffers)
    when autograd saves them; the device's counters do not see those as an increase.
    """
    counted_before = storage_bytes(before) - meter.untracked_bytes(list(before))
    return meter.live_bytes - counted_before, meter.untracked_bytes(list(outputs))


class MemoryWindow(Protocol):
    """A context measuring the device's allocated bytes: ``before`` at entry, ``after`` and ``peak`` at exit."""

    before: int
    after: int
    peak: int

    def __enter__(self) -> Any: ...

    def __exit__(self, *exc: object) -> None: ...


class CudaMemory:
    """``torch.cuda``'s allocation counters around a window (synchronized at both ends)."""

    def __init__(self, device: torch.device) -> None:
        self.device, self.before, self.after, self.peak = device, 0, 0, 0

    def __enter__(self) -> CudaMemory:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.before = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.synchronize(self.device)
        self.after = torch.cuda.memory_allocated(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device)


@dataclass(frozen=True)
class MeterReading:
    meter_bytes: int  # what the meter counted that the forward allocated
    held_bytes: int  # the device's allocation increase still held after F, less the outputs nothing saved
    peak_bytes: int  # the device's peak during F above the level before it


def meter_reading(model: PreTrainedModel, data: tuple[torch.Tensor, torch.Tensor], window: MemoryWindow,
                  *, split: bool) -> MeterReading:
    """Stage 1's metered forward of one micro-batch against the device's counters over it."""
    first, second = split_stages(model)
    store = WeightGradStore() if split else None
    if store is not None:
        enable_split_backward([second], store)
    with torch.no_grad():
        hidden, key_mask = first(data[0])
    inputs = (hidden.requires_grad_(True), key_mask)
    warm_up(second, inputs)
    with window:
        out, meter = metered_forward(second, inputs, store)
    new, unsaved = meter_counts(meter, before=[*inputs, *second.buffers()], outputs=[out])
    return MeterReading(new, window.after - window.before - unsaved, window.peak - window.before)


# ---- c: the host issues the passes ahead of the device -------------------------------------------

# Calls whose result the host needs (a value or a data-dependent shape): on a GPU each one waits
# for every kernel queued before it, so a stage that makes one cannot run ahead of its device.
_SYNCING = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal", "aten::nonzero", "aten::masked_select",
            "aten::_unique2", "aten::unique_consecutive", "aten::unique_dim"}


@dataclass(frozen=True)
class Timing:
    host_s: float  # from the first pass's issue to the last pass's return, on the host
    device_s: float  # from the first pass's start to the last pass's end, on the device


class HostSyncs(TorchDispatchMode):
    """Counts, by operator, the calls that would make the host wait for a GPU (on any device)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None) -> Any:
        name = func.overloadpacket._qualified_op_name
        if name in _SYNCING:
            self.calls[name] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class LastStage:
    """Stage 1 of a split Llama, its store, and per micro-batch what it receives: (hidden, key_mask), labels."""

    stage: Stage
    store: WeightGradStore
    received: list[tuple[torch.Tensor, torch.Tensor]]
    labels: list[torch.Tensor]


def last_stage(model: PreTrainedModel, data: list[tuple[torch.Tensor, torch.Tensor]]) -> LastStage:
    """Stage 1 with split backward on; stage 0 runs once here to make what stage 1 would receive."""
    first, second = split_stages(model)
    store = WeightGradStore()
    enable_split_backward([second], store)
    with torch.no_grad():
        received = [first(ids) for ids, _ in data]
    return LastStage(second, store, [(h.detach(), m) for h, m in received], [labels for _, labels in data])


def stage_passes(last: LastStage) -> None:
    """One step of the stage's passes, zero-bubble style: every F, then B and W per micro-batch."""
    m = len(last.labels)
    losses = []
    for mb, ((hidden, key_mask), labels) in enumerate(zip(last.received, last.labels)):
        leaf = hidden.detach().requires_grad_(True)  # a fresh receive buffer, as the engine's
        with last.store.forward_of((1, mb)):
            logits = last.stage((leaf, key_mask))
        losses.append(hf.causal_lm_loss(logits, labels) / m)
    for mb in range(m):
        with last.store.deferring((1, mb)):
            losses[mb].backward()
        last.store.run((1, mb))


def issue_and_time(last: LastStage) -> Timing:
    """Time one step of the stage's passes on the host (issue) and on the device (events around it).

    Two steps first warm up (library workspaces, the allocator's cache, ``.grad`` allocated):
    the timed one allocates from the cache, since a cudaMalloc or cudaFree would synchronize
    and say nothing about the passes.
    """
    device = last.labels[0].device
    for _ in range(2):
        stage_passes(last)
    _synchronize(device)
    start, end = _event(device), _event(device)
    start.record()
    t0 = time.perf_counter()
    stage_passes(last)
    host = time.perf_counter() - t0
    end.record()
    end.synchronize()
    return Timing(host, start.elapsed_time(end) / 1e3)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _HostEvent:
    """The CPU's stand-in for a CUDA event: the CPU has run every pass when the call returns."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end: _HostEvent) -> float:
        return (end.at - self.at) * 1e3


def _event(device: torch.device) -> Any:
    return torch.cuda.Event(enable_timing=True) if device.type == "cuda" else _HostEvent()
