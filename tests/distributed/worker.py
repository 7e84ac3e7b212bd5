"""One launch, many checks: run each case on real gloo ranks and write what was measured.

Launched by tests/distributed/launch.py (through spawn.py on gloo, torchrun on GPUs). Every
case builds the same small model as a PipelineModule and as a plain nn.Sequential reference,
trains both for a few optimizer steps with gradient clipping, and records the pipeline's
losses and every local parameter's largest difference from the reference. Each rank writes
one JSON file; the pytest side asserts on them, so a failure names the case and the rank.
"""

from __future__ import annotations

import copy
import faulthandler
import gc
import json
import os
import signal
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

_T0 = time.monotonic()  # the worker's start: its imports and init count towards a launch's start-up

# A launch that times out ends its ranks with SIGTERM (launch.run_ranks): each prints every thread's
# stack first, so the log names where it waited, however long its imports took (the timed dump in
# main counts from main's start, which a loaded machine can push past the launch's timeout).
faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)

import torch
import torch.distributed as dist
from torch import nn

import deepspeed
import ds_vshape
from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
from tests.distributed.cpu_fp16 import allow_cpu_fp16

DIM = 8
ROWS = 4  # micro-batch size
# tests/gpu sets DS_VSHAPE_TEST_BACKEND=nccl: NCCL, rank r on cuda:LOCAL_RANK, model and data there.
BACKEND = os.environ.get("DS_VSHAPE_TEST_BACKEND", "gloo")


def _device() -> torch.device:
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if BACKEND == "nccl" else torch.device("cpu")


class Block(nn.Module):
    """Linear + norm + tanh: exercises the split linear path and the autograd fallback."""

    def __init__(self, dim: int = DIM) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(self.fc(x))) + x


class _LinearFn(torch.autograd.Function):
    """A linear layer as one custom autograd Function (as tensor-parallel and fused kernels are):
    computes only the gradients ``ctx.needs_input_grad`` asks for."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.save_for_backward(x, w)
        return nn.functional.linear(x, w, b)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        x, w = ctx.saved_tensors
        need = ctx.needs_input_grad
        g2 = g.reshape(-1, g.shape[-1])
        return (g @ w if need[0] else None, g2.t() @ x.reshape(-1, x.shape[-1]) if need[1] else None,
                g2.sum(0) if need[2] else None)


class CustomBlock(Block):
    """Block whose linear layer is a custom autograd Function: split backward over the graph."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.norm(_LinearFn.apply(x, self.fc.weight, self.fc.bias))) + x


class WideBlock(Block):
    """Block with more intermediates per parameter, as real layers have (the memory cases): split
    backward keeps each parametered op's input and output gradient until W, which for Block
    itself is more than its whole saved activation (``kept_fraction`` above 1)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.fc(x))
        a = torch.tanh(h)
        return a * torch.sigmoid(a) * torch.sigmoid(h) + x


class Embed(nn.Module):
    def __init__(self, vocab: int = 11, dim: int = DIM) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, dim) * 0.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


def _head(embed: Embed, x: torch.Tensor) -> torch.Tensor:
    return x @ embed.weight.t()


def kept_fraction(*, layers: int = 2, block: type[Block] = Block) -> float:
    """Share of one unit's saved activation that split backward parks until W, for Block.

    Measured with the runtime's own meter and store on one process, so the memory test can
    hand the schedule (and the simulator) the true figure for this model.
    """
    from ds_vshape.runtime.measuring.memory import ActivationMeter
    from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward

    torch.manual_seed(0)
    stage = nn.Sequential(*[block() for _ in range(layers)])
    store = WeightGradStore()
    enable_split_backward([stage], store)
    meter = ActivationMeter({p.untyped_storage().data_ptr() for p in stage.parameters()})
    x = torch.randn(ROWS, DIM, requires_grad=True)
    with meter.recording(), store.forward_of("u"):
        out = stage(x)
    saved = meter.live_bytes
    with store.deferring("u"):
        out.backward(torch.ones_like(out))
    return store.parked_bytes / saved


def _mse(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((out - y) ** 2).mean()


def _ce(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


def _layers(n: int, seed: int, *, block: type[Block] = Block) -> list[nn.Module]:
    torch.manual_seed(seed)
    return [block() for _ in range(n)]


def _data(case: dict[str, Any], steps: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1234 + case.get("data_seed", 0))
    out = []
    for i in range(steps * m):
        rows = case["rows"][i % len(case["rows"])] if "rows" in case else ROWS
        if case.get("tied"):
            ids = torch.randint(0, 11, (ROWS, 3), generator=g)
            out.append((ids, torch.randint(0, 11, (ROWS, 3), generator=g)))
        else:
            out.append((torch.randn(rows, DIM, generator=g), torch.randn(rows, DIM, generator=g)))
    return out


def _config(case: dict[str, Any], m: int) -> dict[str, Any]:
    # A short transfer timeout: a broken case fails in a minute instead of hanging the suite.
    pipeline = {"schedule": case["schedule"], "p2p_timeout_s": 60} if case["schedule"] else {}
    pipeline.update(case.get("pipeline", {}))
    return {
        "train_micro_batch_size_per_gpu": ROWS,
        "gradient_accumulation_steps": m,
        "optimizer": {"type": "SGD", "params": {"lr": 0.2, **({"momentum": case["momentum"]} if "momentum" in case else {})}},
        "gradient_clipping": case.get("clip", 0.05),
        "zero_optimization": {"stage": case.get("zero", 0)},
        "zero_allow_untested_optimizer": True,  # plain torch SGD keeps the reference exact
        "pipeline": pipeline,
        "steps_per_print": 10**9,
        "bf16": {"enabled": bool(case.get("bf16"))},
        "wall_clock_breakdown": False,
        **case.get("extra_config", {}),
    }


def _build(case: dict[str, Any], p: int) -> tuple[PipelineModule, nn.Module, Any]:
    n = case.get("layers", 8)
    if case.get("tied"):
        torch.manual_seed(7)
        embed = Embed()
        blocks = _layers(n - 2, seed=11)
        ref = _TiedReference(copy.deepcopy(embed), [copy.deepcopy(b) for b in blocks])
        specs = [TiedLayerSpec("embed", _Clone, embed)] + blocks + [TiedLayerSpec("embed", _Clone, embed, forward_fn=_head)]
        return PipelineModule(specs, num_stages=p, loss_fn=_ce, partition_method="uniform"), ref, _ce
    blocks = _layers(n, seed=5, block=WideBlock if case.get("wide") else CustomBlock if case.get("custom") else Block)
    ref = nn.Sequential(*[copy.deepcopy(b) for b in blocks])
    if case.get("layerspec"):
        # LayerSpecs are rebuilt on each rank: seed them so both sides agree.
        specs = [LayerSpec(_SeededBlock, 100 + i) for i in range(n)]
        ref = nn.Sequential(*[_SeededBlock(100 + i) for i in range(n)])
        return PipelineModule(specs, num_stages=p, loss_fn=_mse, partition_method="uniform",
                              activation_checkpoint_interval=case.get("ckpt", 0)), ref, _mse
    return PipelineModule(blocks, num_stages=p, loss_fn=_mse, partition_method="uniform", dynamic_shape=case.get("dynamic", False),
                          activation_checkpoint_interval=case.get("ckpt", 0)), ref, _mse


class _SeededBlock(Block):
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        super().__init__()


class _Clone(Embed):
    def __init__(self, src: Embed) -> None:
        super().__init__()
        self.weight = nn.Parameter(src.weight.detach().clone())


class _TiedReference(nn.Module):
    def __init__(self, embed: Embed, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed, self.blocks = embed, nn.Sequential(*blocks)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return _head(self.embed, self.blocks(self.embed(ids)))


def _reference(ref: nn.Module, loss_of: Any, data: list, m: int, steps: int, clip: float, *,
               momentum: float = 0.0) -> list[float]:
    """Plain training: ``loss_of(model, x, y)`` per micro-batch, averaged, clipped, SGD."""
    opt = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=momentum)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for x, y in data[step * m : (step + 1) * m]:
            loss = loss_of(ref, x, y)
            (loss / m).backward()
            total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        opt.step()
        losses.append(total / m)
    return losses


def _param_diff(engine: Any, ref: nn.Module, case: dict[str, Any]) -> float:
    """Largest |pipeline - reference| over this rank's parameters, matched by layer index."""
    module = engine.module
    worst = 0.0
    ref_layers = _ref_layers(ref, case)
    for name, param in module.named_parameters():
        head, _, rest = name.partition(".")
        if head == "tied_modules":
            ref_param = ref.embed.weight
        else:
            ref_param = dict(ref_layers[int(head)].named_parameters())[rest]
        worst = max(worst, (param.detach() - ref_param.detach()).abs().max().item())
    return worst


def _ref_layers(ref: nn.Module, case: dict[str, Any]) -> list[nn.Module]:
    if case.get("tied"):
        return [ref.embed] + list(ref.blocks) + [ref.embed]
    return list(ref)


def _hf_config(kind: str, blocks: int = 4) -> Any:
    from transformers import (Gemma2Config, GPT2Config, GPTNeoXConfig, GraniteConfig, Llama4TextConfig,
                              LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config)

    common = {"vocab_size": 96, "num_attention_heads": 4}
    if kind == "gpt2":
        return GPT2Config(n_embd=32, n_layer=blocks, n_head=4, vocab_size=96, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    if kind == "gpt_neox":  # partial rotary, parallel residual; its blocks take the cache as layer_past
        return GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=blocks, max_position_embeddings=64,
                             attention_dropout=0.0, hidden_dropout=0.0, **common)
    if kind == "llama4_text":  # chunked-attention layers: a plain pipeline, refused in sequence chunks
        return Llama4TextConfig(hidden_size=32, intermediate_size=64, intermediate_size_mlp=64, num_hidden_layers=blocks,
                                num_key_value_heads=2, head_dim=8, max_position_embeddings=64, num_local_experts=2,
                                attention_chunk_size=4, **common)
    extra: dict[str, Any] = {
        "qwen3": {"head_dim": 8},
        # The LM post-processes its logits: divides by logits_scaling / soft-caps them.
        "granite": {"logits_scaling": 4.0, "embedding_multiplier": 2.0, "residual_multiplier": 0.5},
        # Gemma2's default pad_token_id 0 would mask the random ids the reference sees unmasked.
        "gemma2": {"head_dim": 8, "sliding_window": 4, "final_logit_softcapping": 2.0, "pad_token_id": None},
    }.get(kind, {})
    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
           "granite": GraniteConfig, "gemma2": Gemma2Config}[kind]
    return cls(hidden_size=32, intermediate_size=64, num_hidden_layers=blocks, num_key_value_heads=2,
               max_position_embeddings=64, tie_word_embeddings=kind in ("qwen2", "gemma2"), **common, **extra)


def run_hf_case(case: dict[str, Any]) -> dict[str, Any]:
    """A transformers model as a pipeline: losses over three steps equal the model's own."""
    from transformers import AutoModelForCausalLM

    from ds_vshape.hf import pipeline_layers

    p, m, steps = case["p"], case["m"], case.get("steps", 3)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_hf_config(case["hf"], case.get("blocks", 4)),
                                             attn_implementation=case.get("attn", "eager")).float()
    if case.get("seq"):
        _distinct_values(model)
    ref = copy.deepcopy(model)
    layers, loss_fn = pipeline_layers(model)
    module = PipelineModule(layers, num_stages=p, loss_fn=loss_fn, partition_method="uniform",
                            activation_checkpoint_interval=case.get("ckpt", 0))
    config = _config(case, m)
    config["gradient_clipping"] = 1.0
    engine, *_ = ds_vshape.initialize(model=module, config=config)
    engine._offload.offload_w = not case.get("w_on_device", False)  # the twin that keeps W's tensors on the device
    twins = _match_by_value(engine, ref) if case.get("seq") else []
    g = torch.Generator().manual_seed(3)
    data = []
    for _ in range(steps * m):
        ids = torch.randint(0, 96, (2, case.get("seq_len", 16)), generator=g)
        labels = ids.clone()
        labels[:, :3] = -100  # ignore-index honoured
        if case.get("seq"):
            labels[1, 8] = -100  # a chunk's first label, and one inside a chunk
            labels[0, 11] = -100
        data.append((ids, labels))
    it = iter(data)
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    ref_losses = _reference(ref, lambda model, ids, labels: model(input_ids=ids, labels=labels).loss, data, m, steps, 1.0)
    diffs = {name: (mine.detach() - theirs.detach()).abs().max().item() for name, mine, theirs in twins}
    worst = max(diffs, key=diffs.__getitem__, default=None)
    result = {"losses": losses, "ref_losses": ref_losses, "param_diff": diffs.get(worst, 0.0), "worst_param": worst,
              "params_compared": len(twins), "peak_activation_bytes": engine.peak_activation_bytes,
              "peak_host_activation_bytes": engine.peak_host_activation_bytes,
              "offloaded_units": engine._offload.offloaded_units, "seq_cuts": [list(c) for c in engine._seq._cuts.values()],
              "w_offloaded_units": engine._offload.w_offloaded_units, "w_planned": len(engine._offload._w_units),
              "peak_breakdown": dict(engine._meter.peak_breakdown),
              "embedding_checked": any(theirs is ref.get_input_embeddings().weight for _, _, theirs in twins),
              "in_b_matrices": sum(p.dim() > 1 and id(p) in engine._store._in_b for p in engine.module.parameters()),
              "w_fit": {str(s): list(v) for s, v in engine._fit.fitted.items()}}
    choice = getattr(engine, "auto_choice", None)
    if choice is not None:
        result["auto"] = {"name": choice.name, "offload": choice.offload, "table": choice.summary()}
    if case.get("eval"):  # forward-only, whole micro-batches, after chunked training
        result["eval_loss"] = engine.eval_batch(iter(data[:m])).item()
        with torch.no_grad():
            ref.eval()
            result["ref_eval_loss"] = sum(ref(input_ids=ids, labels=labels).loss.item() for ids, labels in data[:m]) / m
    return result


def _distinct_values(model: nn.Module) -> None:
    """Nudge every parameter (norm weights start all ones) so that each one's values are its own."""
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn(param.shape, generator=g))


def _match_by_value(engine: Any, ref: nn.Module) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """Pair each of this rank's pipeline parameters with the reference parameter of identical values.

    A tied module's copy on another rank than its owner is left out: parts of it it never runs
    (GPT-2's position embedding next to the head) get no gradient there and are not kept in step.
    """
    pairs = []
    for name, param in engine.module.named_parameters():
        if getattr(param, "ds_pipe_replicated", False):
            continue
        same = [r for r in ref.parameters() if r.shape == param.shape and torch.equal(r.detach(), param.detach())]
        if len(same) != 1:
            raise AssertionError(f"pipeline parameter {name} matches {len(same)} reference parameters by value")
        pairs.append((name, param, same[0]))
    return pairs


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    if "hf" in case:
        return run_hf_case(case)
    if case.get("tp"):
        from tests.distributed.tp_checks import run_tp_case

        return run_tp_case(case)
    if case.get("p2p"):
        from tests.distributed.p2p_checks import run_p2p_case

        return run_p2p_case(case)
    if case.get("fp16"):
        from tests.distributed.fp16_checks import run_fp16_case

        return run_fp16_case(case)
    if case.get("dropin"):
        from tests.distributed.dropin_checks import run_dropin_case

        return run_dropin_case(case)
    if case.get("ckpt_case"):
        from tests.distributed.checkpoint_checks import run_checkpoint_case

        return run_checkpoint_case(case)
    if case.get("ported"):
        from tests.distributed.ported_checks import run_ported_case

        return run_ported_case(case)
    if case.get("batch_check"):
        from tests.distributed.batch_checks import run_batch_case

        return run_batch_case(case)
    if case.get("zero_case"):
        from tests.distributed.zero_checks import run_zero_case

        return run_zero_case(case)
    if case.get("tuning_check"):
        from tests.distributed.tuning_checks import run_tuning_case

        return run_tuning_case(case)
    if case.get("post_validation_case"):
        from tests.distributed import post_validation_checks as pv

        return pv.run_overlap_case(case) if case.get("overlap") else pv.run_post_validation_case(case)
    if case.get("nccl_control"):
        from tests.distributed.nccl_checks import run_stock_control

        return run_stock_control(case)
    if case.get("nccl_selfcheck"):
        from tests.distributed.nccl_checks import run_nccl_selfcheck

        return run_nccl_selfcheck(case)
    p = case["p"]
    m = case["m"]
    steps = case.get("steps", 2)
    model, ref, loss_fn = _build(case, p)
    ref.to(_device())
    engine, *_ = ds_vshape.initialize(model=model, config=_config(case, m))
    data = [(x.to(_device()), y.to(_device())) for x, y in _data(case, steps, m)]
    if case.get("fail_step"):
        return _failed_step(engine, data)
    if case.get("idle_rank") is not None:
        if int(os.environ["RANK"]) == case["idle_rank"]:
            return {"idle": True}
        engine.train_batch(iter(data))  # the idle rank never answers: this must fail, not hang
    it = iter(data)
    _reset_device_peak()
    trace = _trace_b_w(engine) if case.get("bw_trace") else None
    losses = [engine.train_batch(it).item() for _ in range(steps)]
    result: dict[str, Any] = {"losses": losses, "peak_activation_bytes": getattr(engine, "peak_activation_bytes", None),
                              "peak_inflight_bytes": getattr(engine, "peak_inflight_bytes", None), "bw_trace": trace,
                              "peak_host_activation_bytes": getattr(engine, "peak_host_activation_bytes", None),
                              "offloaded_units": engine._offload.offloaded_units if hasattr(engine, "_offload") else None,
                              "global_order": getattr(getattr(engine, "_train_ir", None), "global_order", None)}
    result["device_max_allocated_bytes"] = _device_peak()
    result["ref_losses"] = _reference(ref, lambda model, x, y: loss_fn(model(x), y), data, m, steps, case.get("clip", 0.05))
    result["param_diff"] = _param_diff(engine, ref, case)
    if case.get("eval"):
        result["eval_loss"] = engine.eval_batch(iter(data[:m])).item()
        ref.eval()
        with torch.no_grad():
            result["ref_eval_loss"] = sum(loss_fn(ref(x), y).item() for x, y in data[:m]) / m
    if case.get("checkpoint"):
        result.update(_checkpoint_roundtrip(engine, case, p, m))
    return result


def _trace_b_w(engine: Any) -> list[list[Any]]:
    """Test-only instrumentation: around each B and W handler, how many of the stage's trainable
    parameters had their ``.grad`` changed, and how many of them are cheap (at most one
    dimension). Split backward must leave all but the cheap ones to W."""
    from ds_vshape.runtime.program import instructions as ins

    events: list[list[Any]] = []
    table = dict(engine._INSTRUCTION_MAP)

    def traced(kind: str, handler: Any) -> Any:
        def run(self: Any, **kwargs: Any) -> None:
            params = [p for m in self.module.stage_modules(kwargs["stage"]) for p in m.parameters() if p.requires_grad]
            before = [None if p.grad is None else p.grad.clone() for p in params]
            handler(self, **kwargs)
            changed = sum(not (b is None and p.grad is None or b is not None and p.grad is not None and torch.equal(b, p.grad))
                          for b, p in zip(before, params))
            cheap = sum(p.dim() <= 1 for p in params)
            events.append([kind, kwargs["stage"], kwargs["micro_batch"], changed, len(params), cheap])
        return run

    table[ins.BackwardInput] = traced("B", table[ins.BackwardInput])
    table[ins.BackwardWeight] = traced("W", table[ins.BackwardWeight])
    engine._INSTRUCTION_MAP = table  # this engine only
    return events


def _failed_step(engine: Any, data: list) -> dict[str, Any]:
    """Micro-batch 1 of the first step has the wrong width: that step fails (on the first
    stage, and by timeout on the others). The next step must refuse at once, not hang."""
    x, y = data[1]
    data = [data[0], (torch.cat([x, x], dim=-1), y)] + data[2:]
    errors = []
    for _ in range(2):
        try:
            engine.train_batch(iter(data))
            errors.append(None)
        except Exception as err:  # both steps must fail; the test reads the messages
            errors.append(f"{type(err).__name__}: {err}")
    return {"errors": errors}


def _reset_device_peak() -> None:
    if BACKEND == "nccl":
        torch.cuda.reset_peak_memory_stats(_device())


def _device_peak() -> int | None:
    """Most CUDA memory allocated since the reset (None on the CPU): an upper bound for the meter."""
    return torch.cuda.max_memory_allocated(_device()) if BACKEND == "nccl" else None


def _checkpoint_roundtrip(engine: Any, case: dict[str, Any], p: int, m: int) -> dict[str, Any]:
    """Save under this case's schedule, load under another, compare every parameter."""
    root = case["checkpoint"]["dir"]
    engine.save_checkpoint(root, tag="t")
    other = dict(case, schedule=case["checkpoint"]["load_as"])
    model, _, _ = _build(other, p)
    engine2, *_ = ds_vshape.initialize(model=model, config=_config(other, m))
    engine2.load_checkpoint(root, tag="t", load_optimizer_states=False, load_lr_scheduler_states=False)
    mine = {n: t for n, t in _by_layer(engine).items()}
    theirs = _by_layer(engine2)
    files = sorted(f for f in os.listdir(os.path.join(root, "t")) if f.startswith("layer_"))
    shared = set(mine) & set(theirs)
    # Each rank compares the layers both placements gave it; together the ranks cover all.
    diff = max((float((mine[k] - theirs[k]).abs().max()) for k in shared), default=0.0)
    return {"ckpt_files": files, "ckpt_diff": diff, "ckpt_compared": len(shared)}


def _by_layer(engine: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def main() -> None:
    if os.environ.get("DS_VSHAPE_TEST_DUMP_AFTER_S"):  # a hang shows every thread's stack before launch gives up
        faulthandler.dump_traceback_later(float(os.environ["DS_VSHAPE_TEST_DUMP_AFTER_S"]), exit=False)
    cases = json.load(open(sys.argv[1]))
    out_dir = sys.argv[2]
    if os.environ.get("DS_VSHAPE_NCCL_EMULATION"):
        # Before any process group exists (and before deepspeed.comm caches its all-gather and
        # reduce-scatter functions), so that every call from here on is emulated.
        from tests.distributed import nccl_emulation

        nccl_emulation.install(mode=nccl_emulation.env_mode(os.environ["DS_VSHAPE_NCCL_EMULATION"]))
    if BACKEND == "nccl":
        torch.cuda.set_device(_device())
    else:
        allow_cpu_fp16()
    deepspeed.init_distributed(dist_backend=BACKEND)
    rank = int(os.environ.get("RANK", "0"))
    results = {}
    seconds = {"_start": time.monotonic() - _T0}  # the worker's imports and init, before its first case
    for case in cases:
        contacts, synced = _first_contacts_made(), _synchronizes()
        began = time.monotonic()
        try:
            results[case["name"]] = run_case(case)
            if isinstance(results[case["name"]], dict):  # what the case connected under the first-contact rule
                results[case["name"]]["first_contacts"] = _first_contacts_made() - contacts
                results[case["name"]]["synchronizes"] = [a - b for a, b in zip(_synchronizes(), synced)]
        except Exception as err:  # recorded per case so one failure does not hide the rest
            results[case["name"]] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
        # The case's engines form reference cycles: finalize them here, between cases, not at whatever
        # point of a later case the collector would (DeepSpeed's finalizer synchronizes the device).
        gc.collect()
        seconds[case["name"]] = time.monotonic() - began
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    with open(os.path.join(out_dir, f"rank{rank}.seconds.json"), "w") as fh:  # launch.py's time log reads it
        json.dump(seconds, fh)
    if not _wedged():
        _tear_down()
    _leave()


def _first_contacts_made() -> int:
    """First contacts this rank made under the emulation's first-contact rule so far (0 without it)."""
    emulation = sys.modules.get("tests.distributed.nccl_emulation")
    return emulation.first_contacts_made() if emulation is not None else 0


def _synchronizes() -> tuple[int, int]:
    """Accelerator synchronizes under the emulation's synchronize rule so far: (all, those that
    found transfers or collectives outstanding and waited for them); (0, 0) without it."""
    emulation = sys.modules.get("tests.distributed.nccl_emulation")
    return (emulation.synchronizes(), emulation.synchronizes_waited()) if emulation is not None else (0, 0)


def _tear_down() -> None:
    """Destroy the process groups before the rank ends (``_leave``), as a job does.

    A case that timed out on purpose leaves gloo pairs closed, so the barrier fails there: the
    results are written, so the rank just ends.
    """
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # a pair closed by an intended timeout
        pass


THREADS_END_S = 30.0  # how long the threads that would hold up the interpreter's exit get to end


def _leave() -> None:
    """End the rank without the interpreter's finalization, once the results are written: finalizing
    torch and DeepSpeed takes seconds of C-level teardown on every rank, which each launch paid (and
    with gloo's threads still holding work it aborted a rank now and then). What that finalization
    would show first, a thread that keeps the process from exiting (a user's job would hang at its
    end), fails the rank here instead."""
    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    deadline = time.monotonic() + THREADS_END_S
    for thread in others:  # the interpreter would wait for each of them before exiting
        thread.join(timeout=max(deadline - time.monotonic(), 0.0))
    stuck = [t.name for t in others if t.is_alive()]
    if stuck:
        print(f"worker: non-daemon threads still running {THREADS_END_S:.0f} s after the cases ended, which would keep "
              f"the process from exiting: {stuck}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if stuck else 0)


def _wedged() -> bool:
    """Whether emulated p2p pairs are wedged: the barrier and the groups' destruction would then hang
    or abort the rank, so it ends without them."""
    emulation = sys.modules.get("tests.distributed.nccl_emulation")
    return emulation is not None and bool(emulation.unfinished_ops())


if __name__ == "__main__":
    tempfile.tempdir = os.environ.get("TMPDIR", tempfile.gettempdir())
    main()
