"""Host cost of one pipeline stage's passes where the host is the bottleneck (issue 28, part a).

``make bench-host`` (with ``host_engine.py``); alone::

    OMP_NUM_THREADS=1 python benchmarks/host_stage.py            # writes benchmarks/results/host_stage.md

Tiny shapes on one thread: every kernel takes microseconds, so a pass's wall time is what the
host spends on it (Python, the dispatcher, autograd nodes), the regime of eager Hugging Face
blocks at about 1k tokens per micro-batch on an H100. The stage is a middle one of the recipe's
tiny Llama (hidden 64, FFN 176, 4 heads), ``--blocks`` decoder blocks, micro-batches of 4
sequences. Four ways of running one micro-batch, the same weights:

* ``forward``: the forward alone, with autograd recording (what a plain forward costs);
* ``fused``: the forward and a fused backward, as DeepSpeed's 1F1B runs them;
* ``torch split``: torch's own split (``torch.distributed.pipelining._backward``): B is
  ``stage_backward_input``, W ``stage_backward_weight``;
* ``ds_vshape``: the forward routed for split backward, B deferring (with the store's parking at its
  end), W ``WeightGradStore.run``.

The ways take turns rep by rep, in a fresh random order each rep, the garbage collector off; each pass's
median over the reps. Ratios are against ``fused`` F+B (whole micro-batch) and ``forward`` (F).

On a CUDA device (``--device cuda --dtype bf16``, with ``--hidden/--ffn/--heads/--kv-heads`` for
Llama-3-8B-sized blocks: the GPU tier's ``tests/gpu/test_host_cost_gpu.py`` runs the issue's
shapes) each pass also gets its device time (CUDA events around it; the host does not wait
inside a micro-batch) and what W keeps: the bytes allocated at the end of B that W frees.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads its thread pools

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import platform  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from contextlib import AbstractContextManager  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from ds_vshape.hf import pipeline_layers  # noqa: E402
from ds_vshape.runtime.split.split_backward import WeightGradStore, enable_split_backward  # noqa: E402
from recipes.train_hf import SIZES, seed_layer  # noqa: E402

__all__ = ["WAYS", "Stage", "build", "build_from", "main", "measure", "render", "run_stage", "shape_options", "stage_parser",
           "write_report"]

WAYS = ("forward", "fused", "torch split", "ds_vshape")
PASSES = ("F", "B", "W")
SEED, VOCAB = 1234, 256
Passes = dict[str, float]


@dataclass
class Stage:
    """The stage's copies per way (ds_vshape's with its store), its input and the output gradient."""

    modules: dict[str, list[nn.Module]]
    store: WeightGradStore
    x0: tuple[Any, ...]
    grad: torch.Tensor
    key: int = 0
    device: torch.device = torch.device("cpu")

    def inputs(self) -> tuple[Any, ...]:
        return (self.x0[0].detach().requires_grad_(), *self.x0[1:])


def build(*, blocks: int, seq_len: int, micro_batch: int, size: str = "tiny", shape: tuple[int, int, int, int] | None = None,
          device: str = "cpu", dtype: torch.dtype = torch.float32) -> Stage:
    """``blocks`` decoder blocks after the embedding of the recipe's Llama at ``size``, or of ``shape``
    (hidden, FFN, heads, KV heads), on ``device`` in ``dtype``."""
    from transformers import LlamaConfig

    hidden, _, heads, ffn = SIZES[size]
    kv_heads = heads
    if shape is not None:
        hidden, ffn, heads, kv_heads = shape
    config = LlamaConfig(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=blocks, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=VOCAB, max_position_embeddings=max(seq_len, 128),
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=None)
    specs, _ = pipeline_layers(config, attn_implementation="sdpa")
    layers = []
    for index, spec in enumerate(specs[:blocks + 1]):
        seed_layer(SEED + index)
        layers.append(spec.build().to(device=device, dtype=dtype))
    ids = torch.randint(0, VOCAB, (micro_batch, seq_len), generator=torch.Generator().manual_seed(SEED)).to(device)
    with torch.no_grad():
        x0 = layers[0](ids)
    stage = layers[1:]
    store = WeightGradStore()
    split = [copy.deepcopy(m) for m in stage]
    enable_split_backward(split, store)
    modules = {"forward": stage, "fused": stage, "torch split": [copy.deepcopy(m) for m in stage], "ds_vshape": split}
    out = run_stage(stage, x0)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(SEED + 1)).to(device=device, dtype=out.dtype)
    return Stage(modules, store, x0, grad, device=torch.device(device))


def run_stage(modules: list[nn.Module], x: Any) -> torch.Tensor:
    for m in modules:
        x = m(x)
    return x[0] if isinstance(x, tuple) else x


class _Clock:
    """Host seconds per pass (what the host spends issuing it), and on CUDA the device's span (events)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.host: Passes = {}
        self.events: dict[str, tuple[Any, Any]] = {}
        self.kept = 0

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        if self.cuda:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        start = time.perf_counter()
        result = fn()
        self.host[name] = time.perf_counter() - start
        if self.cuda:
            end.record()
            self.events[name] = (begin, end)
        return result

    def allocated(self) -> int:
        return torch.cuda.memory_allocated() if self.cuda else 0

    def finish(self) -> Passes:
        """Host seconds per pass, with ``dev:<pass>`` device seconds and ``kept`` W's bytes on CUDA."""
        out = dict(self.host)
        if self.cuda:
            torch.cuda.synchronize()
            out.update({f"dev:{n}": b.elapsed_time(e) / 1e3 for n, (b, e) in self.events.items()})
            out["kept"] = float(self.kept)
        return out


def run_way(stage: Stage, way: str) -> Passes:
    """One micro-batch's passes in ``way``: seconds per pass (and device seconds, W's bytes on CUDA)."""
    modules, clock = stage.modules[way], _Clock(stage.device)
    x = stage.inputs()
    start = time.perf_counter()
    _passes(stage, way, modules, x, clock)
    out = clock.finish()
    out["wall"] = time.perf_counter() - start  # the micro-batch done, device included (it waited for it)
    return out


def _passes(stage: Stage, way: str, modules: list[nn.Module], x: tuple[Any, ...], clock: _Clock) -> None:
    if way == "ds_vshape":
        stage.key += 1
        key, store = stage.key, stage.store
        # Each pass's clock takes in its context: the store's bookkeeping at B's end (parking what the
        # GEMM captures handed over) is B's cost, as it is in the engine's BackwardInput.
        out = clock("F", lambda: _within(store.forward_of(key, scope="stage"), lambda: run_stage(modules, x)))
        clock("B", lambda: _within(store.deferring(key), lambda: torch.autograd.backward(out, stage.grad)))
        del out
        before = clock.allocated()
        clock("W", lambda: store.run(key))
        clock.kept = before - clock.allocated()
        return
    out = clock("F", lambda: run_stage(modules, x))
    if way == "fused":
        clock("B", lambda: torch.autograd.backward(out, stage.grad))
    elif way == "torch split":
        params = [p for m in modules for p in m.parameters()]
        _, groups = clock("B", lambda: stage_backward_input([out], [stage.grad], [x[0]], iter(params)))
        del out
        before = clock.allocated()
        clock("W", lambda: stage_backward_weight(iter(params), groups))
        del groups
        clock.kept = before - clock.allocated()


def _within(context: AbstractContextManager[Any], fn: Callable[[], Any]) -> Any:
    with context:
        return fn()


def measure(stage: Stage, *, reps: int, warmup: int) -> dict[str, dict[str, float]]:
    """Median seconds per pass and way; the ways rotate rep by rep, the collector off while timed."""
    samples: dict[str, list[Passes]] = {w: [] for w in WAYS}
    gc.collect()
    gc.disable()
    try:
        order = random.Random(SEED)
        for rep in range(warmup + reps):
            # A fresh order each rep: a rotation keeps each way behind the same other way (the cyclic
            # order stays), and a pass that follows another on the same modules runs on warm caches.
            for way in order.sample(WAYS, len(WAYS)):
                times = run_way(stage, way)
                for m in stage.modules[way]:
                    m.zero_grad(set_to_none=True)
                if rep >= warmup:
                    samples[way].append(times)
            gc.collect()
    finally:
        gc.enable()
    medians = {}
    for way, runs in samples.items():
        per = {name: statistics.median(r[name] for r in runs) for name in runs[0]}
        per["host"] = statistics.median(sum(v for k, v in r.items() if k in PASSES) for r in runs)
        medians[way] = per
    return medians


def render(medians: dict[str, dict[str, float]], *, setting: str, command: str) -> str:
    """The table: per way, host ms per pass (and device ms, W's bytes on CUDA), ratios to fused F+B and plain F."""
    cuda = "dev:F" in medians["fused"]
    fused, plain_f = medians["fused"]["wall"], medians["forward"]["F"]
    head = "| way | F | B | W | host F+B(+W) | micro-batch | x fused | F x plain |"
    lines = [f"# Host cost of one stage's passes ({'CUDA' if cuda else 'host-bound: tiny shapes, one thread'})", "",
             f"Measured on: {setting}.", f"Command: `{command}`", "",
             "Median ms per pass of the host's time (on the CPU, all of it)" + (", `dev` the device's span per pass, `W keeps` "
             "what W frees (MiB)" if cuda else "") + "; `micro-batch`: its whole time, device included; `x fused` that "
             "against fused F+B's, `F x plain` the way's forward against the plain forward.", "",
             head + (" dev F | dev B | dev W | W keeps |" if cuda else ""),
             "|---|--:|--:|--:|--:|--:|--:|--:|" + ("--:|--:|--:|--:|" if cuda else "")]
    for way in WAYS:
        m = medians[way]
        cells = [f"{m[p] * 1e3:.3f}" if p in m else "-" for p in PASSES]
        ratio = "-" if way == "forward" else f"{m['wall'] / fused:.2f}x"
        row = f"| {way} | {' | '.join(cells)} | {m['host'] * 1e3:.3f} | {m['wall'] * 1e3:.3f} | {ratio} | {m['F'] / plain_f:.2f}x |"
        if cuda:
            dev = [f"{m['dev:' + p] * 1e3:.3f}" if "dev:" + p in m else "-" for p in PASSES]
            row += f" {' | '.join(dev)} | {m['kept'] / 2**20:.1f} |" if "kept" in m and way in ("torch split", "ds_vshape") else \
                f" {' | '.join(dev)} | - |"
        lines.append(row)
    ds, torch_split = medians["ds_vshape"], medians["torch split"]
    lines += ["", "Targets (issue 28): on a CPU, ds_vshape's micro-batch <= 1.10x fused and below torch's split, F <= 1.05x "
              "a plain forward; on a GPU <= 1.10x fused at 1024 tokens, <= 1.02x at 4096.",
              f"Here: {ds['wall'] / fused:.2f}x fused, torch's split {torch_split['wall'] / fused:.2f}x, "
              f"F {ds['F'] / plain_f:.2f}x plain.", ""]
    return "\n".join(lines)


def stage_parser(description: str, *, reps: int) -> argparse.ArgumentParser:
    """The stage's size and the timing's repetitions, as this bench and the benches built on its stage take them."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--blocks", type=int, default=4, help="decoder blocks in the stage")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    parser.add_argument("--micro-batch", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--reps", type=int, default=reps, help="timed micro-batches per way")
    parser.add_argument("--warmup", type=int, default=20, help="untimed micro-batches per way first")
    return parser


def shape_options(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The blocks' size, device and dtype, as this bench and the benches built on its stage take them."""
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny", help="the recipe's model size")
    parser.add_argument("--shape", type=int, nargs=4, metavar=("HIDDEN", "FFN", "HEADS", "KV_HEADS"),
                        help="blocks of this shape instead of --size (Llama-3-8B: 4096 14336 32 8)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda for the GPU tier's shapes")
    parser.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="the stage's parameters and activations")
    return parser


def build_from(args: argparse.Namespace) -> Stage:
    """The stage ``stage_parser`` and ``shape_options`` describe, seeded."""
    torch.manual_seed(SEED)
    return build(blocks=args.blocks, seq_len=args.seq_len, micro_batch=args.micro_batch, size=args.size,
                 shape=tuple(args.shape) if args.shape else None, device=args.device,
                 dtype=torch.bfloat16 if args.dtype == "bf16" else torch.float32)


def write_report(text: str, out: Path) -> int:
    """Print the report and write it to ``out``; the exit status."""
    print(text)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = shape_options(stage_parser(__doc__.split("\n\n")[0], reps=200))
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "host_stage.md", help="report path")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stage = build_from(args)
    medians = measure(stage, reps=args.reps, warmup=args.warmup)
    hidden = args.shape[0] if args.shape else SIZES[args.size][0]
    where = (torch.cuda.get_device_name() if args.device.startswith("cuda") else
             f"{platform.processor() or platform.machine()} CPU, {torch.get_num_threads()} thread")
    setting = (f"{where}, torch {torch.__version__}, {args.dtype}; {args.blocks} Llama blocks of hidden {hidden}"
               f"{' (FFN %d, %d heads, %d KV heads)' % tuple(args.shape[1:]) if args.shape else ''}, micro-batch "
               f"{args.micro_batch}x{args.seq_len} tokens, median of {args.reps} reps")
    command = "OMP_NUM_THREADS=1 python benchmarks/host_stage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    return write_report(render(medians, setting=setting, command=command.strip()), args.out)


if __name__ == "__main__":
    raise SystemExit(main())
